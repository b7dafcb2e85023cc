"""Only here to install zerofix-autopatch.pth into site-packages, for regular and editable installs.

The .pth is one guarded line: it does nothing unless ZEROFIX is set (see zerofix/activation.py).
"""
import os
import re

from setuptools import setup
from setuptools.command.build_py import build_py

PTH = os.path.join("zerofix", "_bootstrap", "zerofix-autopatch.pth")


class build_py_with_pth(build_py):
    def run(self):
        super().run()
        self.copy_file(PTH, os.path.join(self.build_lib, os.path.basename(PTH)), preserve_mode=0)


# README.md links into the repository (docs/check.md, CHANGELOG.md): relative links, which break on a package index's
# page. The long description names them as paths of the source distribution instead, which ships them (MANIFEST.in).
RELATIVE_LINK = re.compile(r"\[([^\]]+)\]\((?!https?:|#|mailto:)([^)#\s]+)(#[^)\s]*)?\)")


def long_description() -> str:
    with open("README.md", encoding="utf-8") as f:
        text = f.read()

    def plain(m):
        label, path = m[1], m[2]
        where = f"`{path}` in the source distribution"
        return f"{label} ({where})" if label.strip("`") != path else where

    return RELATIVE_LINK.sub(plain, text)


cmdclass = {"build_py": build_py_with_pth}

try:
    from setuptools.command.editable_wheel import editable_wheel
except ImportError:  # setuptools < 64: `setup.py develop` has no .pth of ours; use `zerofix run`
    pass
else:

    class editable_wheel_with_pth(editable_wheel):
        # An editable wheel ships the files of its unpacked directory; put the .pth there too.
        def _run_build_commands(self, dist_name, unpacked_wheel, *args, **kwargs):
            result = super()._run_build_commands(dist_name, unpacked_wheel, *args, **kwargs)
            self.copy_file(PTH, os.path.join(str(unpacked_wheel), os.path.basename(PTH)), preserve_mode=0)
            return result

    cmdclass["editable_wheel"] = editable_wheel_with_pth

setup(cmdclass=cmdclass, long_description=long_description(), long_description_content_type="text/markdown")
