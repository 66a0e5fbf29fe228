"""Builds the optional C fast path of the seat ledger (``apf_gunicorn.ledger._fastpath``).

Everything else is in pyproject.toml. Without a C compiler the build skips the extension
(``optional=True``) and the ledger runs its pure-Python fast path instead.
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "apf_gunicorn.ledger._fastpath",
            ["apf_gunicorn/ledger/_fastpath.c"],
            # generated from layout.py (scripts/layout_header.py) and committed, so the build
            # needs no Python step; listed so a changed header rebuilds and ships in the sdist
            depends=["apf_gunicorn/ledger/_layout.h"],
            # the same float operations in the same order as the Python path: no fused
            # multiply-add; the buffer is read through int64, uint64 and double pointers
            extra_compile_args=["-O2", "-ffp-contract=off", "-fno-strict-aliasing"],
            optional=True,
        )
    ]
)
