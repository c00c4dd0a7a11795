"""The error a failed job's reason quotes from its replica's log (gpulab.hub.jobs.local)."""

from gpulab.hub.jobs.rules import error_summary


def test_the_last_exception_and_the_persons_line_are_quoted():
    log = b"""GPULAB_PROGRESS {"step": 1}
gpulab runtime: worker-0 starting
Traceback (most recent call last):
  File "/opt/gpulab/venv/lib/python3.11/site-packages/gpulab/extensions/runtime.py", line 9, in run
  File "/srv/shared/users/ann/jobs/x/source.py", line 3, in <module>
    import mnist_setup
  File "/opt/gpulab/venv/lib/python3.11/site-packages/keras/src/x.py", line 9, in f
    raise X
ModuleNotFoundError: No module named 'mnist_setup'
gpulab runtime: the program raised ModuleNotFoundError; exit 1
GPULAB_PROGRESS {"step": 2}
"""
    assert error_summary(log) == "ModuleNotFoundError: No module named 'mnist_setup' (source.py, line 3)"


def test_a_chained_exception_quotes_the_last_one():
    log = b"""Traceback (most recent call last):
  File "/data/train.py", line 5, in <module>
KeyError: 'lr'

During handling of the above exception, another exception occurred:

Traceback (most recent call last):
  File "/data/train.py", line 7, in <module>
RuntimeError: no learning rate
"""
    assert error_summary(log) == "RuntimeError: no learning rate (train.py, line 7)"


def test_no_traceback_no_summary_and_long_errors_are_cut():
    assert error_summary(b"epoch 1\nkilled\n") == ""
    assert error_summary(b"") == ""
    long = b"Traceback (most recent call last):\nValueError: " + b"x" * 1000 + b"\n"
    out = error_summary(long)
    assert len(out) == 400 and out.endswith("\u2026") and out.startswith("ValueError: xxx")


def test_the_persons_files_below_a_gpulab_folder_are_theirs():
    """The default data folder as root is /var/lib/gpulab, and code given as text is mounted
    at /gpulab/job-source on Kubernetes: frames there are the person's (their helper module
    too), gpulab's runtime is not, wherever it is installed."""
    log = b"""Traceback (most recent call last):
  File "/work/gpulab/extensions/runtime.py", line 530, in _run_program
  File "/var/lib/gpulab/shared/users/ann/jobs/x/code/source.py", line 9, in <module>
  File "/var/lib/gpulab/shared/users/ann/jobs/x/code/mnist_setup.py", line 14, in mnist_dataset
ValueError: bad shape
"""
    assert error_summary(log) == "ValueError: bad shape (mnist_setup.py, line 14)"
    kube = log.replace(b"/var/lib/gpulab/shared/users/ann/jobs/x/code", b"/gpulab/job-source")
    assert error_summary(kube) == "ValueError: bad shape (mnist_setup.py, line 14)"
