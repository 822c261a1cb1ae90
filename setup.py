"""Only for the optional C accelerator; everything else is in pyproject.toml.

`optional=True`: where no C compiler is available the build goes on without it, and
kvdepot.native falls back to pure Python (same results, slower lookups).
"""

from setuptools import Extension, setup

setup(ext_modules=[Extension(
    "kvdepot.native._native",
    ["src/kvdepot/native/_native.c"],
    extra_compile_args=["-O3"],
    optional=True,
)])
