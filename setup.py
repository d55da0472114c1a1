"""The one compiled part: the slot pool's hot path (src/hybridkv/ram/_slotpool.c).

Optional: without a C compiler the package installs and runs on the pure-Python pool.
Everything else about the package is in pyproject.toml.
"""

from setuptools import Extension, setup

setup(ext_modules=[Extension("hybridkv.ram._slotpool", ["src/hybridkv/ram/_slotpool.c"],
                             extra_compile_args=["-O2"], optional=True)])
