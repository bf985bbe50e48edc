"""The C helper's build; everything else is in pyproject.toml.

``optional``: where no compiler or Python headers are found the install
still succeeds, and ``dispatch status`` says the helper is absent
(``dispatchd/tools/native.py``); the set-up and CI install both, and the
tests import it.
"""

from setuptools import Extension, setup

setup(ext_modules=[Extension("dispatchd.tools._lines", ["dispatchd/tools/_lines.c", "dispatchd/tools/_fastread.c",
                                                        "dispatchd/tools/_spawn.c", "dispatchd/tools/_confined.c",
                                                        "dispatchd/tools/_ctimes.c"],
                             depends=["dispatchd/tools/_lines.h"],
                             extra_compile_args=["-O2", "-Wall", "-Wextra", "-Wno-unused-parameter"],
                             optional=True)])
