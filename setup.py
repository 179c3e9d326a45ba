"""tierkv's two C extensions; everything else about the package is in pyproject.toml.

- ``tierkv._keychain`` hashes the key chain (:mod:`tierkv.keys`).
- ``tierkv._streamcopy`` copies chunks between arrays with non-temporal stores
  (:mod:`tierkv.arraycopy`).
- ``tierkv._piecewise`` writes chunk files from the pool and reads page-cached ones into it,
  checksummed on the way (:mod:`tierkv.piecewise_io`); it links libxxhash (``libxxhash-dev``).

All are optional: without a C compiler, Python's headers, OpenSSL's (``libssl-dev``) or
xxHash's (``libxxhash-dev``), tierkv installs anyway, hashes the same keys in Python, copies
with numpy and reads chunk files with ``os.preadv``, slower (``tierkv.keys.NATIVE_CHAIN``,
``tierkv.arraycopy.STREAMING`` and ``tierkv.piecewise_io.NATIVE`` say which).
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "tierkv._keychain",
            sources=["src/tierkv/_keychain.c"],
            libraries=["crypto"],
            extra_compile_args=["-O2", "-Wall"],
            optional=True,
        ),
        Extension(
            "tierkv._streamcopy",
            sources=["src/tierkv/_streamcopy.c"],
            depends=["src/tierkv/_stream.h"],
            extra_compile_args=["-O2", "-Wall"],
            optional=True,
        ),
        Extension(
            "tierkv._piecewise",
            sources=["src/tierkv/_piecewise.c"],
            depends=["src/tierkv/_stream.h"],
            libraries=["xxhash"],
            extra_compile_args=["-O2", "-Wall"],
            optional=True,
        ),
    ]
)
