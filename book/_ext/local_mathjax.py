"""Serve MathJax from the built book, so its math renders with no network.

MathJax 3 comes from the ``django-static-mathjax`` wheel (static files only; it does not need or
import Django). After the HTML build, the self-contained SVG bundle is copied to
``_static/mathjax/``, which is where ``mathjax_path`` in ``_config.yml`` points.
"""

from __future__ import annotations

import shutil
from pathlib import Path

BUNDLE = "tex-svg-full.js"


def mathjax_bundle() -> Path:
    try:
        import mathjax  # the package django-static-mathjax installs
    except ImportError as err:
        raise RuntimeError(
            "MathJax is not installed: pip install --no-deps django-static-mathjax"
        ) from err
    path = Path(mathjax.__file__).parent / "static" / "mathjax" / "es5" / BUNDLE
    if not path.is_file():
        raise RuntimeError(f"MathJax bundle not found at {path}")
    return path


def copy_mathjax(app, exception) -> None:
    if exception is None and app.builder.format == "html":
        target = Path(app.outdir) / "_static" / "mathjax"
        target.mkdir(parents=True, exist_ok=True)
        shutil.copy2(mathjax_bundle(), target / BUNDLE)


def setup(app):
    mathjax_bundle()  # fail early, before a long build, if MathJax is missing
    app.connect("build-finished", copy_mathjax)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
