"""tierkv's one C extension; everything else about the package is in pyproject.toml.

``tierkv._keychain`` hashes the key chain (:mod:`tierkv.keys`). It is optional: without a C
compiler, Python's headers or OpenSSL's (``libssl-dev``), tierkv installs anyway and hashes
the same keys in Python, slower (``tierkv.keys.NATIVE_CHAIN`` says which).
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
        )
    ]
)
