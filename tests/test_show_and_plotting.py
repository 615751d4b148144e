import functools
from pathlib import Path

import matplotlib
import pytest

matplotlib.use("Agg")

import torch  # noqa: E402

from gpt2kimi.accounting import gpt2_param_count  # noqa: E402
from gpt2kimi.gpt2 import GPT2, Block  # noqa: E402
from gpt2kimi.plotting import (  # noqa: E402
    COLORS,
    COLUMN_WIDTH,
    mean_and_range,
    new_axes,
    plot_history,
    use_style,
)
from gpt2kimi.show import source_of  # noqa: E402
from gpt2kimi.train import History  # noqa: E402


def line_range(where: str) -> tuple[int, int]:
    first, last = map(int, where.split("lines ")[1].split("-"))
    return first, last


def test_source_of_points_at_the_library():
    source, where = source_of(gpt2_param_count)
    assert source.startswith("def gpt2_param_count")
    assert where.startswith("gpt2kimi/accounting.py, lines ")
    first, last = line_range(where)
    assert last - first + 1 == len(source.splitlines())
    assert source_of(Block)[0].startswith("class Block")


def test_source_of_unwraps_decorated_functions():
    # torch.no_grad() wraps the method in a function defined in torch/utils/_contextlib.py;
    # the caption must still name the library file, with the decorator in the shown source.
    source, where = source_of(GPT2.generate)
    assert where.startswith("gpt2kimi/gpt2.py, lines "), where
    assert source.lstrip().startswith("@torch.no_grad()")
    assert "def generate(" in source
    first, last = line_range(where)
    assert last - first + 1 == len(source.splitlines())

    def wrap(fn):
        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            return fn(*args, **kwargs)

        return wrapper

    @wrap
    @torch.no_grad()
    def twice_decorated(x):
        return x

    source, where = source_of(twice_decorated)
    here = Path(__file__)
    assert where.startswith(f"{here.parent.name}/{here.name}, lines "), where
    assert "def twice_decorated(x):" in source and "def wrapper" not in source


def test_plotting_style_and_history():
    use_style()
    # Inline figures are 100 dpi, so the default figure fits the book's column at full size.
    assert matplotlib.rcParams["figure.dpi"] == 100
    assert matplotlib.rcParams["figure.figsize"][0] <= COLUMN_WIDTH
    ax = new_axes("title states the finding", "step", "loss (nats)")
    assert ax.get_xlabel() == "step" and ax.get_title() == "title states the finding"
    h = History(steps=[0, 1, 2], train_loss=[3.0, 2.0, 1.0], val_steps=[3], val_loss=[1.5])
    ax = plot_history(h, label="x")
    assert len(ax.lines) == 2
    assert {"softmax", "linear", "deltanet", "gated_deltanet", "kda"} <= set(COLORS)


def test_mean_and_range_gives_errorbar_distances_to_min_and_max():
    means, bars = mean_and_range([[0.5, 1.0, 0.0], [0.25], [0.2, 0.4]])
    assert means == pytest.approx([0.5, 0.25, 0.3])
    assert bars[0] == pytest.approx([0.5, 0.0, 0.1])  # down to each group's min
    assert bars[1] == pytest.approx([0.5, 0.0, 0.1])  # up to each group's max
    with pytest.raises(ValueError, match="non-empty groups"):
        mean_and_range([[1.0], []])


def test_markdown_table_aligns_and_checks_its_shape():
    from gpt2kimi.show import markdown_table

    table = markdown_table(["n", "ratio"], [[16, "10.8"], [32, "19.3"]],
                           caption="Table 2.1. Ratios")
    assert table.splitlines() == [
        "**Table 2.1. Ratios**",
        "",
        "| n | ratio |",
        "|:--|--:|",
        "| 16 | 10.8 |",
        "| 32 | 19.3 |",
    ]
    assert markdown_table(["a", "b"], [], align="rl").splitlines()[1] == "|--:|:--|"
    with pytest.raises(ValueError, match="cells"):
        markdown_table(["a", "b"], [[1]])
    with pytest.raises(ValueError, match="align"):
        markdown_table(["a", "b"], [], align="lc")
