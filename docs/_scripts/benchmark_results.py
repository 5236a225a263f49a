"""An mkdocs hook: serve the benchmarks' recorded results with the site.

`docs/benchmarks.md` (written by `python -m benchmarks.report`) embeds each benchmark's
PNG plot and links its JSON under `assets/benchmarks/`. The files stay where the
benchmarks write them, `benchmarks/results/`: this hook adds them to the site's files
before the pages are built, so that the links resolve (and `mkdocs build --strict` checks
them) with no copies in `docs/`.
"""

import pathlib

from mkdocs.structure.files import File


RESULTS = pathlib.Path(__file__).parents[2] / "benchmarks" / "results"
TARGET = "assets/benchmarks"


def on_files(files, config, **kwargs):
    for path in sorted(RESULTS.glob("*.png")) + sorted(RESULTS.glob("*.json")):
        files.append(File.generated(config, f"{TARGET}/{path.name}", abs_src_path=str(path)))
    return files
