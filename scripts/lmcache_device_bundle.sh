#!/usr/bin/env bash
# LMCache 0.5.6 for the offline GPU machine, on top of vLLM 0.26's bundle
# (../shared/tools/device-vllm: vLLM and its dependencies in /tmp/site).
#
# What is carried: the lmcache wheel and the packages that its multiprocess server
# (`python -m lmcache.v1.multiprocess.http_server`, what `lmcache server` and LMCache's own
# auto-start run) and vLLM's LMCacheMPConnector import on their way and that neither the
# GPU machine's image nor vLLM's bundle has. Found by reading LMCache's import graph (module
# level, the packages it imports by discovery, and the lazy imports that its default
# configuration runs):
#   cryptography   lmcache.v1.distributed.serde.{aesgcm,key_provider}, imported at start
#   cffi           cryptography's Rust extension imports _cffi_backend when it loads
#   uvicorn        lmcache.v1.multiprocess.http_server
#   opentelemetry-exporter-prometheus
#                  lmcache.v1.mp_observability.otel_init (metrics are on by default)
# The image already has numba, llvmlite, aiohttp, sortedcontainers, cupy-cuda13x,
# cuda-bindings, numpy, torch; vLLM's bundle has fastapi, httpx, msgspec, pyzmq, blake3,
# cachetools, opentelemetry-api/sdk 1.45, prometheus-client, nvtx, pydantic.
#
# Versions: the exporter is 0.66b2, the release paired with the opentelemetry-sdk 1.45.2
# that vLLM's bundle carries. lmcache 0.5.6's metadata asks for <=0.61b0 (with
# opentelemetry-api<=1.40, prometheus-client<=0.24.1, numpy<=2.2.6), which vLLM's bundle
# and the image already contradict; LMCache only constructs PrometheusMetricReader() with
# no arguments, which 0.66b2 has. uvicorn 0.55.0 needs click and h11 (image); cryptography
# 51.0.1 needs cffi>=2.0.0; cffi's pycparser is needed only to build, not to load.
#
# usage (from the project checkout's root): scripts/lmcache_device_bundle.sh
#   writes .lmc/p1, p2, ... (git-ignored), each at most 50 MiB; the last holds install.sh.
#   On the GPU machine, after vLLM's bundle is installed, with every part copied into
#   /tmp/lmc/ (one run per part): bash /tmp/lmc/install.sh
set -euo pipefail
top=$(git rev-parse --show-toplevel)
cd "$top"
out=.lmc
cache=${LMC_CACHE:-/tmp/lmc-cache}
mkdir -p "$cache/whl"
# package==version, one each: exactly these are carried
pins=(lmcache==0.5.6 cryptography==51.0.1 cffi==2.0.0 uvicorn==0.55.0
      opentelemetry-exporter-prometheus==0.66b2)
for spec in "${pins[@]}"; do
  name=${spec%%==*}; version=${spec##*==}
  stem=$(echo "$name" | tr - _)
  if ! ls "$cache/whl/${stem}-${version}-"*.whl >/dev/null 2>&1; then
    # glibc 2.28 at most, like vLLM's bundle (lmcache's own wheel is manylinux_2_28)
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
      --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
      --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform any \
      -d "$cache/whl" "$spec" 2>&1 | grep -v '^WARNING' || true
  fi
  ls "$cache/whl/${stem}-${version}-"*.whl >/dev/null
done
# lmcache's CUDA extensions must be the CUDA 13 build (the GPU machine's torch is cu130)
python3 - "$cache"/whl/lmcache-0.5.6-*.whl <<'EOF'
import sys, zipfile
with zipfile.ZipFile(sys.argv[1]) as z:
    so = z.read("lmcache/cuda_ops.cpython-312-x86_64-linux-gnu.so")
if b"libcudart.so.13" not in so:
    sys.exit("lmcache wheel: cuda_ops is not linked against libcudart.so.13")
EOF
rm -rf "$out" && mkdir -p "$out"
# Whole wheels, in parts of at most 50 MiB; a wheel over 50 MiB would be cut in pieces.
limit=$((50 * 1024 * 1024))
part=1; used=0
mkdir -p "$out/p1"
for w in $(ls -S "$cache"/whl/*.whl); do
  base=$(basename "$w")
  for spec in "${pins[@]}"; do
    stem=$(echo "${spec%%==*}" | tr - _)
    [[ $base == "${stem}-${spec##*==}-"* ]] && keep=1 && break || keep=0
  done
  [ "$keep" = 1 ] || continue
  size=$(stat -c %s "$w")
  if [ "$size" -gt "$limit" ]; then
    echo "$base is over 50 MiB; cut it with split before carrying" >&2; exit 1
  fi
  if [ $((used + size)) -gt "$limit" ]; then part=$((part + 1)); used=0; mkdir -p "$out/p$part"; fi
  cp "$w" "$out/p$part/"; used=$((used + size))
done
cat > "$out/p$part/install.sh" <<'EOF'
#!/usr/bin/env bash
# On the GPU machine, after vLLM's bundle is in /tmp/site and every part of this one was
# copied into /tmp/lmc/: lmcache 0.5.6 and what it lacks, into /tmp/site.
# The wheels go to a staging folder first and are then merged in: `pip install --target
# /tmp/site --upgrade` would delete /tmp/site/opentelemetry (the namespace vLLM's bundle
# filled with api and sdk) to put the exporter alone there, and without --upgrade it
# would skip the exporter.
set -euo pipefail
rm -rf /tmp/lmc-site
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/lmc-site \
  /tmp/lmc/*.whl
mkdir -p /tmp/site
cp -a /tmp/lmc-site/. /tmp/site/
# What the image gives and lmcache needs, with its versions; then the imports the server
# and the connector make at start. A failure here is printed, not fatal: the bench records
# LMCache's failure itself and runs the other engines.
PYTHONPATH=/tmp/site python3 - <<'PY' || true
import importlib
for name in ("lmcache", "numba", "llvmlite", "aiohttp", "cryptography", "cffi", "uvicorn",
             "sortedcontainers", "cupy", "numpy", "torch", "prometheus_client", "fastapi"):
    try:
        module = importlib.import_module(name)
        print(name, getattr(module, "__version__", "?"))
    except Exception as exc:
        print(name, "MISSING:", type(exc).__name__, exc)
for name in ("lmcache.v1.multiprocess.http_server",
             "lmcache.integration.vllm.lmcache_mp_connector",
             "opentelemetry.exporter.prometheus",
             "cryptography.hazmat.primitives.ciphers.aead"):
    try:
        importlib.import_module(name)
        print("import", name, "ok")
    except Exception as exc:
        print("import", name, "FAILED:", type(exc).__name__, exc)
PY
EOF
du -b "$out"/p*/* | awk '{printf "%10.1f MiB  %s\n", $1 / 1048576, $2}'
du -sb "$out"/p* | awk '{printf "%10.1f MiB  %s\n", $1 / 1048576, $2}'
echo "send $out/p1 ... $out/p$part along, one per run, each copied into /tmp/lmc/; then bash /tmp/lmc/install.sh"
