"""The build step pyproject.toml cannot declare: the sparse table's row kernel (ps/_rowkernel.c).

Plain C (no Python headers), loaded by ps/rowkernel.py with ctypes. ``optional``: where it cannot be
compiled (no C compiler), ``pip install`` still succeeds and the shards run the numpy path, saying
so once at start and in ``tessera ps stats``.
"""
from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "ps._rowkernel",
            sources=["ps/_rowkernel.c"],
            # no contraction of a*b+c into an FMA the source does not write: the kernel must give the
            # torch path's floats bit for bit (ps/_rowkernel.c says which ones torch fuses)
            extra_compile_args=["-O3", "-ffp-contract=off", "-fno-math-errno", "-std=c11"],
            optional=True,
        )
    ],
)
