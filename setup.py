"""Only for `pip install -e .`: setuptools' editable wheel asks the distribution for `has_data`
where the method is `has_data_files`, so an editable install leaves data files out (the man
pages: `man lorafleet` would find nothing; pypa/setuptools#3399). This installs them as a regular
install does. Everything else is in pyproject.toml."""

from setuptools import setup
from setuptools.command.editable_wheel import editable_wheel


class EditableWithData(editable_wheel):
    def _run_install(self, category):
        if category == "data" and self.distribution.has_data_files():
            self.run_command("install_data")
        else:
            super()._run_install(category)


setup(cmdclass={"editable_wheel": EditableWithData})
