"""tierkv's C extensions; everything else about the package is in pyproject.toml.

- ``tierkv._keychain`` hashes the key chain (:mod:`tierkv.keys`).
- ``tierkv._streamcopy`` copies chunks between arrays with non-temporal stores
  (:mod:`tierkv.arraycopy`).
- ``tierkv._piecewise`` moves chunks between the pool and files or sockets without the GIL,
  checksummed on the way (:mod:`tierkv.piecewise_io`); it links libxxhash (``libxxhash-dev``).
- ``tierkv._fingerprints`` computes the controller's key fingerprints in one pass and
  searches its lookup filter and key tables (:mod:`tierkv.controller.keytable`,
  :mod:`tierkv.controller.holders`).

All are optional: without a C compiler, Python's headers, OpenSSL's (``libssl-dev``) or
xxHash's (``libxxhash-dev``), tierkv installs anyway and does the same in Python and numpy,
slower (``tierkv.keys.NATIVE_CHAIN``, ``tierkv.arraycopy.STREAMING``,
``tierkv.piecewise_io.NATIVE`` and ``tierkv.controller.keytable.NATIVE_FINGERPRINTS`` say
which).
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
            "tierkv._fingerprints",
            sources=["src/tierkv/_fingerprints.c"],
            extra_compile_args=["-O2", "-Wall"],
            optional=True,
        ),
        Extension(
            "tierkv._piecewise",
            sources=["src/tierkv/_piecewise.c"],
            depends=["src/tierkv/_stream.h", "src/tierkv/_xxh3_copy.h"],
            libraries=["xxhash"],
            extra_compile_args=["-O2", "-Wall"],
            optional=True,
        ),
    ]
)
