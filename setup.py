"""tierkv's two C extensions; everything else about the package is in pyproject.toml.

- ``tierkv._keychain`` hashes the key chain (:mod:`tierkv.keys`).
- ``tierkv._streamcopy`` copies chunks between arrays with non-temporal stores
  (:mod:`tierkv.arraycopy`).

Both are optional: without a C compiler, Python's headers or OpenSSL's (``libssl-dev``),
tierkv installs anyway, hashes the same keys in Python and copies with numpy, slower
(``tierkv.keys.NATIVE_CHAIN`` and ``tierkv.arraycopy.STREAMING`` say which).
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
            extra_compile_args=["-O2", "-Wall"],
            optional=True,
        ),
    ]
)
