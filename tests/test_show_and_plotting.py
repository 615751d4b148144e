import matplotlib

matplotlib.use("Agg")

from gpt2kimi.gpt2 import Block, gpt2_param_count  # noqa: E402
from gpt2kimi.plotting import COLORS, new_axes, plot_history, use_style  # noqa: E402
from gpt2kimi.show import source_of  # noqa: E402
from gpt2kimi.train import History  # noqa: E402


def test_source_of_points_at_the_library():
    source, where = source_of(gpt2_param_count)
    assert source.startswith("def gpt2_param_count")
    assert where.startswith("gpt2kimi/gpt2.py, lines ")
    first, last = map(int, where.split("lines ")[1].split("-"))
    assert last - first + 1 == len(source.splitlines())
    assert source_of(Block)[0].startswith("class Block")


def test_plotting_style_and_history():
    use_style()
    ax = new_axes("title states the finding", "step", "loss (nats)")
    assert ax.get_xlabel() == "step" and ax.get_title() == "title states the finding"
    h = History(steps=[0, 1, 2], train_loss=[3.0, 2.0, 1.0], val_steps=[3], val_loss=[1.5])
    ax = plot_history(h, label="x")
    assert len(ax.lines) == 2
    assert {"softmax", "linear", "deltanet", "gated_deltanet", "kda"} <= set(COLORS)
