"""The one compiled part: the diff's row kernel (probe/_rowdiff.c), loaded with ctypes by probe/rowdiff.py.

Everything else is in pyproject.toml. The extension is optional: without a C compiler the install still succeeds
and the probe compares rows with numpy (same results, several times slower; the probe says so when it runs).
"""

from setuptools import Extension, setup

setup(ext_modules=[Extension("probe._rowdiff", sources=["probe/_rowdiff.c"], depends=["probe/_rowdiff_lanes.h"],
                             extra_compile_args=["-O3", "-Wno-psabi"], optional=True)])
