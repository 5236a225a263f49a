"""An mkdocs hook: ship MathJax with the built site, so that the maths renders offline.

MathJax comes from the `django-static-mathjax` package on PyPI (a copy of the MathJax 3
npm package, with no dependencies), installed with the docs extras. Its `es5/` folder, the
one the MathJax CDN serves, is copied to `assets/mathjax/` after each build; `mkdocs.yml`
loads `assets/mathjax/tex-mml-chtml.js` from there.
"""

import importlib.resources
import pathlib
import shutil


TARGET = pathlib.PurePosixPath("assets/mathjax")


def _mathjax_es5() -> pathlib.Path:
    try:
        root = importlib.resources.files("mathjax")
    except ModuleNotFoundError:
        raise RuntimeError(
            "The documentation ships MathJax from the `django-static-mathjax` package, which "
            "is not installed: `pip install -c constraints.txt -e '.[docs]'` (`make docs` "
            "does)."
        ) from None
    es5 = pathlib.Path(str(root)) / "static" / "mathjax" / "es5"
    if not (es5 / "tex-mml-chtml.js").is_file():
        raise RuntimeError(f"No MathJax in {es5}: reinstall `django-static-mathjax`.")
    return es5


def on_config(config, **kwargs):
    _mathjax_es5()  # fail before building, not after
    return config


def on_post_build(config, **kwargs):
    target = pathlib.Path(config["site_dir"]) / TARGET
    shutil.copytree(_mathjax_es5(), target, dirs_exist_ok=True)
