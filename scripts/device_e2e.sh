#!/usr/bin/env bash
# `kvdepot bench e2e --device cuda` on the offline GPU machine, whose calls end after at most
# 10 minutes while a full run with all five engines takes 7-9: the bench runs in a session of
# its own, outliving the call that started it, as long as the machine is kept (the next call
# comes within its idle limit).
#
# Before it, on that machine: vLLM 0.26's bundle (../shared/tools/device-vllm, into
# /tmp/site), kvdepot's wheels (../shared/tools/device-wheels.sh, into /tmp/site) and, for
# the lmcache engine, LMCache's (scripts/lmcache_device_bundle.sh: its install.sh merges
# them in without replacing vLLM's `opentelemetry`, which `pip --target --upgrade` would).
#
# usage, in the project checkout there:
#   scripts/device_e2e.sh start [BENCH ARGUMENTS...]   build the C extension, start the bench
#                                                      (default: all five engines, 5 prompts
#                                                      per length), then wait
#   scripts/device_e2e.sh wait                         wait again for a bench still running
# Each waits at most WAIT seconds (default 540), then copies the bench's output and JSON to
# $OUT (what the machine's call sends back) and prints the output's end.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=/tmp/site:$PWD/src
run=/tmp/kvdepot-device-e2e
if [ "${1:-}" = start ]; then
  shift
  # 5 prompts per length: medians of 3 moved by 10 ms at 32,768 tokens between two runs
  # on one machine (docs/benchmarks.md, 2026-12-07 08:32 and 08:44)
  [ $# -gt 0 ] || set -- --layers 32 --prompts 5 --engines none,noop,kvdepot,offload,lmcache \
    --throughput-prompts 32 --throughput-tokens 2048 --output-tokens 16 --repeats 2
  python3 setup.py build_ext --inplace > /tmp/kvdepot-build.log 2>&1 \
    || { tail -20 /tmp/kvdepot-build.log; exit 1; }
  rm -rf "$run" && mkdir -p "$run"
  setsid nohup python3 -m kvdepot.cli bench e2e --device cuda "$@" --json "$run/e2e.json" \
    > "$run/e2e.log" 2>&1 < /dev/null &
  echo $! > "$run/pid"
elif [ "${1:-}" != wait ]; then
  echo "usage: $0 start [BENCH ARGUMENTS...] | wait" >&2; exit 2
fi
pid=$(cat "$run/pid")
end=$((SECONDS + ${WAIT:-540}))
while kill -0 "$pid" 2>/dev/null && [ $SECONDS -lt $end ]; do sleep 5; done
kill -0 "$pid" 2>/dev/null && echo "STILL RUNNING: call '$0 wait' within the machine's idle limit" \
  || echo FINISHED
[ -n "${OUT:-}" ] && cp "$run"/e2e.* "$OUT"/ 2>/dev/null
tail -c 9000 "$run/e2e.log"
