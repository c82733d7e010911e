"""Running the course notebooks: ``python -m helpers.notebooks FILE...`` (``make notebooks``) executes each in place.

The committed outputs come from this run on CPU (the interpreter is forced, so they are the same on any machine),
never from hand edits. The Colab badge every notebook opens with is built here from the one repository name.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

REPOSITORY = "softmax-course/softmax-in-triton"  # GitHub owner/name: the Colab badges point here
BRANCH = "main"


def colab_badge(notebook: str) -> str:
    """The Markdown of the "Open in Colab" badge for ``notebooks/<notebook>``."""
    url = f"https://colab.research.google.com/github/{REPOSITORY}/blob/{BRANCH}/notebooks/{notebook}"
    return f"[![Open In Colab](https://colab.research.google.com/assets/colab-badge.svg)]({url})"


COLAB_CHECKOUT = "/content/softmax-in-triton"


def colab_setup_cell() -> str:
    """The first code cell of every notebook. On Colab it clones the course so ``import helpers`` works, and installs
    nothing: Colab's own torch and triton stay as they are. Anywhere else it does nothing."""
    return f'''import sys

if "google.colab" in sys.modules:  # on Colab: fetch the course's helpers; Colab's torch and triton stay untouched
    import os
    import subprocess

    if not os.path.isdir("{COLAB_CHECKOUT}"):
        subprocess.run(["git", "clone", "--quiet", "--depth=1", "https://github.com/{REPOSITORY}",
                        "{COLAB_CHECKOUT}"], check=True)
    sys.path.insert(0, "{COLAB_CHECKOUT}")'''


def execute(path: Path) -> None:
    """Run every cell of the notebook at ``path`` top to bottom on CPU and write the outputs back."""
    import nbformat
    from nbclient import NotebookClient

    notebook = nbformat.read(path, as_version=4)
    assert colab_badge(path.name) in "".join(notebook.cells[0].source), f"{path.name}: first cell lacks its badge"
    first_code = next(cell for cell in notebook.cells if cell.cell_type == "code")
    assert first_code.source == colab_setup_cell(), f"{path.name}: first code cell is not the Colab setup cell"
    os.environ["SOFTMAX_INTERPRET"] = "1"  # the kernel process inherits it: recorded outputs are CPU outputs
    client = NotebookClient(notebook, timeout=1200, kernel_name="python3",
                            resources={"metadata": {"path": str(path.parent)}})
    client.execute()
    nbformat.write(notebook, path)


def main(paths: list[str]) -> None:
    for name in paths:
        print(f"executing {name}", flush=True)
        execute(Path(name))


if __name__ == "__main__":
    main(sys.argv[1:])
