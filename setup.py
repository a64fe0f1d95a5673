"""The compiled parts, each loaded with ctypes: the diff's row kernel (probe/_rowdiff.c, by probe/rowdiff.py) and
the FP8 block dequant (oracle/_fp8dequant.c, by oracle/fp8.py).

Everything else is in pyproject.toml. Both extensions are optional: without a C compiler the install still succeeds
and their numpy specifications run instead (same results, several times slower; each says so when it runs).
"""

from setuptools import Extension, setup

setup(ext_modules=[
    Extension("probe._rowdiff", sources=["probe/_rowdiff.c"], depends=["probe/_rowdiff_lanes.h"],
              extra_compile_args=["-O3", "-Wno-psabi"], optional=True),
    Extension("oracle._fp8dequant", sources=["oracle/_fp8dequant.c"], extra_compile_args=["-O3"], optional=True),
])
