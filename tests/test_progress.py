"""Progress bars: on in a terminal, off in a notebook kernel, and the environment decides first."""

import sys
from types import SimpleNamespace

import pytest

from gpt2kimi import progress as progress_module
from gpt2kimi.progress import ENV, progress, progress_enabled, say


@pytest.mark.parametrize("setting, expected", [("0", False), ("1", True)])
def test_environment_setting_wins(monkeypatch, setting, expected):
    monkeypatch.setenv(ENV, setting)
    monkeypatch.setattr(progress_module, "in_jupyter_kernel", lambda: not expected)
    assert progress_enabled() is expected


@pytest.mark.parametrize("in_kernel", [True, False])
def test_default_is_off_in_a_kernel_and_on_elsewhere(monkeypatch, in_kernel):
    monkeypatch.delenv(ENV, raising=False)
    monkeypatch.setattr(progress_module, "in_jupyter_kernel", lambda: in_kernel)
    assert progress_enabled() is (not in_kernel)


def test_kernel_detection_asks_the_running_shell(monkeypatch):
    def fake_ipython(config):
        shell = SimpleNamespace(config=config) if config is not None else None
        return SimpleNamespace(get_ipython=lambda: shell)

    monkeypatch.delitem(sys.modules, "IPython", raising=False)
    assert not progress_module.in_jupyter_kernel()
    monkeypatch.setitem(sys.modules, "IPython", fake_ipython(None))  # imported, no shell
    assert not progress_module.in_jupyter_kernel()
    monkeypatch.setitem(sys.modules, "IPython", fake_ipython({}))  # a terminal IPython
    assert not progress_module.in_jupyter_kernel()
    monkeypatch.setitem(sys.modules, "IPython", fake_ipython({"IPKernelApp": {}}))
    assert progress_module.in_jupyter_kernel()


def test_silent_bar_takes_the_same_calls_and_draws_nothing(monkeypatch, capsys):
    monkeypatch.setenv(ENV, "0")
    bar = progress(total=3, desc="runs")
    for _ in range(3):
        bar.set_postfix(loss="1.000", refresh=False)
        bar.update()
    bar.close()
    assert list(progress(range(4))) == [0, 1, 2, 3]
    say("step 1/3")
    out, err = capsys.readouterr()
    assert out == "step 1/3\n" and err == ""


def test_live_bar_counts_to_its_total_on_stderr(monkeypatch, capsys):
    monkeypatch.setenv(ENV, "1")
    bar = progress(total=2, desc="runs", unit="run")
    bar.update()
    bar.update()
    bar.close()
    _, err = capsys.readouterr()
    assert "runs" in err and "2/2" in err


def test_a_kernel_without_ipywidgets_gets_the_text_bar_and_no_warning(monkeypatch, recwarn):
    monkeypatch.setenv(ENV, "1")
    monkeypatch.setattr(progress_module, "in_jupyter_kernel", lambda: True)
    monkeypatch.setattr(progress_module.importlib.util, "find_spec", lambda name: None)
    assert progress_module.bar_class() is progress_module.text_tqdm
    progress(total=1).close()
    assert not recwarn.list


def test_importing_the_library_does_not_import_tqdm_auto():
    # tqdm.auto warns on stderr in a kernel without ipywidgets: that would land in notebook outputs
    import subprocess

    code = "import sys, gpt2kimi.train; print('tqdm.auto' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False" and out.stderr == ""
