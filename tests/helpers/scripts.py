"""The repository's scripts/ imported as modules, so a test calls ``main(argv)`` in its own process (an exit
code back, output through capsys) instead of starting Python and importing torch again for each case."""
import importlib.util
from pathlib import Path

SCRIPTS = Path(__file__).resolve().parents[2] / "scripts"


def load_script(name: str):
    """``scripts/<name>`` as a fresh module; its ``main(argv)`` returns the exit code."""
    spec = importlib.util.spec_from_file_location(name.removesuffix(".py"), SCRIPTS / name)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
