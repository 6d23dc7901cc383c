"""The compiled block operations (`wasma.core._blockops`); everything else is in
pyproject.toml. A machine without a C compiler still installs: the package then uses
the pure-Python reference (`wasma.core.blockops`)."""

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext


class OptionalBuildExt(build_ext):
    """Build the extension if a compiler is there; otherwise go on without it."""

    def run(self) -> None:
        try:
            super().run()
        except Exception as exc:
            print(f"wasma: compiled block operations not built ({exc}); using Python")

    def build_extension(self, ext: Extension) -> None:
        try:
            super().build_extension(ext)
        except Exception as exc:
            print(f"wasma: {ext.name} not built ({exc}); using Python")


setup(
    ext_modules=[Extension("wasma.core._blockops", ["core/_blockops.c"])],
    cmdclass={"build_ext": OptionalBuildExt},
)
