"""The compiled parts: the slot pool's hot path (src/hybridkv/ram/_slotpool.c) and the page
index's probe (src/hybridkv/tiers/_page_probe.c).

Optional: without a C compiler the package installs and runs on their pure-Python versions.
Everything else about the package is in pyproject.toml.
"""

from setuptools import Extension, setup

setup(ext_modules=[Extension(name, [source], extra_compile_args=["-O2"], optional=True)
                   for name, source in (("hybridkv.ram._slotpool", "src/hybridkv/ram/_slotpool.c"),
                                        ("hybridkv.tiers._page_probe", "src/hybridkv/tiers/_page_probe.c"))])
