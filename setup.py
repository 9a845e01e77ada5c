from setuptools import setup

setup(cffi_modules=["nccl_cffi/_build.py:ffibuilder"])
