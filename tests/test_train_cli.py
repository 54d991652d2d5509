"""python -m models.train as a user meets it: a bad flag or an unusable path is one line
naming the flag, exit 2, before anything is traced; Ctrl-C says at once what it will do, saves
at the end of the step, a second one stops at once unsaved (never half a checkpoint); an
interrupted run says so on stdout; another run's checkpoints, a mesh or layout that does not
fit, and a diverging run are refused or stopped with what was kept."""

from __future__ import annotations

import io
import os
import re
import signal
import threading
import time

import jax
import pytest

from models import hparams, llama, loop, placement, train, train_step
from tests.runs import curve, launch, main_err, wait_for_steps


def _refused_before_training(monkeypatch, capsys, *argv) -> str:
  """``argv``'s one-line usage error, from checks that run before ``train`` is called."""
  def reached(*args, **kwargs):
    raise AssertionError(f"{argv}: training began; the flag was not checked first")
  monkeypatch.setattr(train, "train", reached)
  code, err = main_err(capsys, *argv)
  assert code == 2, (argv, err)
  assert err.count("\n") == 1 and err.startswith("python -m models.train: error: "), err
  return err


@pytest.mark.parametrize("argv, says", [
    (["--preset", "huge"], "argument --preset: invalid choice: 'huge' (choose from 'tiny', "),
    (["--remat", "most"], "argument --remat: invalid choice: 'most'"),
    (["--kernels", "cuda"], "argument --kernels: invalid choice: 'cuda'"),
    (["--stream", "int8"], "argument --stream: invalid choice: 'int8'"),
    (["--reference-ops", "norm,mlps"], "argument --reference-ops: 'norm,mlps': 'mlps' is not one"),
    (["--checkpoint-every", "0"], "argument --checkpoint-every: '0' must be a whole number >= 1"),
    (["--log-every", "-3"], "argument --log-every: '-3' must be a whole number >= 1"),
    (["--remat", "auto", "--remat-budget", "-1"], "argument --remat-budget: '-1' must be a "
     "number of GiB > 0"),
    (["--remat", "auto", "--remat-budget", "nan"], "argument --remat-budget: 'nan' must be"),
    (["--remat-budget", "8"], "--remat-budget 8: only --remat auto reads it (this run's remat "
     "is none)"),
    (["--mesh", "data=1,,fsdp=1"], "--mesh 'data=1,,fsdp=1' has an empty part"),
    (["--mesh", "data=1,"], "--mesh 'data=1,' has an empty part"),
    (["--steps", "0"], "--steps 0: must be at least 1"),
], ids=lambda v: " ".join(v) if isinstance(v, list) else "")
def test_a_bad_flag_is_one_line_naming_it(argv, says, monkeypatch, capsys):
  assert says in _refused_before_training(monkeypatch, capsys, *argv)


@pytest.mark.parametrize("flag", ["--checkpoint-dir", "--metrics", "--compilation-cache"])
def test_a_path_that_cannot_be_written_is_a_usage_error(flag, tmp_path, monkeypatch, capsys):
  """Under a file (no directory can be made there), or a directory where a file is wanted
  and the reverse: the flag named, before anything is traced (at the first save, the
  checkpoint directory's was a 25-line traceback after the steps had run), nothing made."""
  blocker = tmp_path / "a-file"
  blocker.write_text("")
  err = _refused_before_training(monkeypatch, capsys, flag, str(blocker / "under"))
  assert f"{flag} {blocker / 'under'}: cannot be made: {blocker} is a file" in err, err
  wrong = tmp_path if flag == "--metrics" else blocker
  err = _refused_before_training(monkeypatch, capsys, flag, str(wrong))
  assert f"{flag} {wrong}: is a " in err, err


def test_paths_that_do_not_exist_yet_are_made_by_the_run(tmp_path, capsys):
  argv = ["--steps", "1", "--batch", "8", "--seq-len", "32", "--checkpoint-dir",
          str(tmp_path / "a" / "ckpt"), "--metrics", str(tmp_path / "b" / "c" / "m.jsonl"),
          "--compilation-cache", str(tmp_path / "d" / "xla")]
  code, err = main_err(capsys, *argv)
  assert code == 0, err
  assert (tmp_path / "a" / "ckpt" / "1").is_dir() and (tmp_path / "b" / "c" / "m.jsonl").is_file()


class _Clock(io.StringIO):
  """A stream that notes when each write came."""

  def __init__(self):
    super().__init__()
    self.at = []

  def write(self, text):
    self.at.append(time.monotonic())
    return super().write(text)


def _kill_after(seconds: float, times: int = 1) -> None:
  def send():
    time.sleep(seconds)
    for _ in range(times):  # apart: two pending SIGINTs are delivered as one
      os.kill(os.getpid(), signal.SIGINT)
      time.sleep(0.1)
  threading.Thread(target=send, daemon=True).start()


def test_the_first_signal_is_answered_while_the_device_is_waited_for():
  """The loop waits for the device through loop.waited: the first SIGINT's message is out
  at once, not when a 2-second wait (a slow step) returns; the wait then goes on."""
  assert threading.current_thread() is threading.main_thread()  # where signals land
  stream = _Clock()
  with loop.Stopper(stream, saves=True) as stopper:
    began = time.monotonic()
    _kill_after(0.2)
    assert loop.waited(lambda: time.sleep(2) or "done") == "done"
    ended = time.monotonic()
  assert stopper.received == signal.SIGINT
  said = stream.getvalue()
  assert "SIGINT: the run stops once the step in flight ends, then saves it" in said, said
  assert stream.at[0] - began < 1.0 and ended - began >= 2.0, (stream.at, began, ended)
  stream = io.StringIO()
  loop.Stopper(stream, saves=False)._receive(signal.SIGTERM, None)
  assert "ends, and saves nothing (no --checkpoint-dir); SIGTERM again" in stream.getvalue()


def test_a_second_signal_stops_the_wait_at_once_but_never_a_save():
  with loop.Stopper(io.StringIO()):
    began = time.monotonic()
    _kill_after(0.2, times=2)
    with pytest.raises(loop.Interrupted):
      loop.waited(time.sleep, 2)
    assert time.monotonic() - began < 1.5
  stream = io.StringIO()
  with loop.Stopper(stream) as stopper:
    with pytest.raises(loop.Interrupted):
      with stopper.save():
        _kill_after(0.1, times=2)
        time.sleep(0.8)  # the save: both signals land inside it
        saved = True
    assert saved and "a checkpoint is being written; the run stops as it ends" in (
        stream.getvalue())
  while loop.abandoned():  # the first case's sleep, left behind on the worker
    time.sleep(0.05)


def test_two_sigints_stop_at_once_and_leave_whole_checkpoints(tmp_path):
  """Two Ctrl-Cs in a row: exit 130 without a traceback or an abort (a worker thread left
  waiting inside XLA), stdout says interrupted, and the directory holds only whole
  checkpoints, from which the same command trains to the end."""
  checkpoints = tmp_path / "checkpoints"
  extra = ("--checkpoint-dir", str(checkpoints), "--checkpoint-every", "2",
           "--no-compilation-cache")
  process, metrics = launch(tmp_path, "twice", *extra)
  wait_for_steps(process, metrics, 3)
  process.send_signal(signal.SIGINT)
  time.sleep(0.1)  # apart: two pending SIGINTs are delivered as one
  process.send_signal(signal.SIGINT)
  out = process.communicate(timeout=300)[0]
  assert process.returncode == 128 + signal.SIGINT, out
  assert "Traceback" not in out and "terminate called" not in out, out
  assert re.search(r"^interrupted at step \d+ by SIGINT", out, re.M) and "final loss" not in out
  assert "by a second SIGINT" in out or "by SIGINT; saved" in out, out
  assert all(p.name.isdigit() for p in checkpoints.iterdir()), os.listdir(checkpoints)
  resumed, _ = launch(tmp_path, "twice", *extra)
  out = resumed.communicate(timeout=300)[0]
  assert resumed.returncode == 0 and "final loss" in out, out
  assert sorted(curve(metrics)) == list(range(1, 25))


def test_bad_input_names_itself(tmp_path, capsys):
  short = tmp_path / "short.txt"
  short.write_text("too short")
  code, err = main_err(capsys, "--corpus", str(short), "--steps", "2", "--warmup", "0")
  assert code == 2 and "the corpus (9 bytes) is shorter than one batch" in err
  code, err = main_err(capsys, "--corpus", str(tmp_path / "nowhere"))
  assert code == 2 and "no such file or directory" in err


def test_mesh_flag_names_what_it_takes(capsys, monkeypatch):
  """--mesh: an unknown axis, an axis twice, a size that is not a whole number, sizes whose
  product is not the device count: each a usage error saying what is accepted."""
  monkeypatch.setattr(placement, "all_devices", lambda: jax.devices()[:8])
  for value, says in (
      ("data=2,model=4", "has an unknown axis 'model'; the axes are data, fsdp, tensor, "
       "sequence"),
      ("data=2,data=4", "names axis 'data' twice"),
      ("data2", "is not of the form axis=size"),
      ("tensor=two", "tensor='two' must be a whole number >= 1"),
      ("data=3", "--mesh data=3,tensor=1,sequence=1 must divide the 8 devices"),
      ("data=2,fsdp=2,tensor=4", "holds 16 devices; there are 8")):
    code, err = main_err(capsys, "--mesh", value)
    assert code == 2 and says in err, (value, err)


def test_flags_are_checked_and_help_shows_defaults(capsys):
  for argv, says in ((["--learning-rate", "-1"], "--learning-rate -1.0: must be a finite"),
                     (["--learning-rate", "nan"], "--learning-rate nan: must be a finite"),
                     (["--steps", "5", "--warmup", "5"], "--warmup 5: must be in [0, --steps 5)"),
                     (["--clip", "0"], "--clip 0.0: must be"),
                     (["--seed", "-1"], "--seed -1: must be a whole number in [0, 2**32)"),
                     (["--seed", str(2**32)], f"--seed {2**32}: must be")):
    code, err = main_err(capsys, *argv)
    assert code == 2 and says in err, (argv, err)
  assert train.main(["--help"]) == 0
  out = capsys.readouterr().out
  assert "(default: 300)" in out and "(default: 0.003)" in out and "(default: 0)" in out
  # A short run takes a warmup of a tenth of its steps (the fixed 30 refused any run <= 30).
  assert hparams.TrainConfig(steps=10).warmup == 1 and hparams.TrainConfig().warmup == 30


def test_sigint_saves_and_the_same_command_resumes(tmp_path):
  checkpoints = tmp_path / "checkpoints"
  process, metrics = launch(tmp_path, "interrupted", "--checkpoint-dir", str(checkpoints),
                             "--checkpoint-every", "100", "--no-compilation-cache")
  wait_for_steps(process, metrics, 3)
  process.send_signal(signal.SIGINT)
  out = process.communicate(timeout=300)[0]
  assert process.returncode == 128 + signal.SIGINT, out
  stopped = int(re.search(r"stopped at step (\d+) by SIGINT; saved: the same command resumes",
                          out).group(1))
  assert "Traceback" not in out and 3 <= stopped < 24
  # At once, before the step ends: what it will do, and what a second one does.
  assert "SIGINT: the run stops once the step in flight ends, then saves it; SIGINT again" in out
  # stdout says it was interrupted (a script reading "final loss" took it for a finished run).
  assert f"interrupted at step {stopped} by SIGINT: loss " in out and "final loss" not in out
  resumed, _ = launch(tmp_path, "interrupted", "--checkpoint-dir", str(checkpoints),
                       "--checkpoint-every", "100", "--no-compilation-cache")
  out = resumed.communicate(timeout=300)[0]
  assert resumed.returncode == 0 and f"resumed at step {stopped}" in out, out
  assert sorted(curve(metrics)) == list(range(1, 25))


def test_a_signal_that_lands_mid_step_is_saved_where_it_stops(tmp_path, capsys, monkeypatch):
  """SIGINT read between a step's save decision and its stop check (the GPU check's run said
  "stopped at step 55 ... saved" and its resume began at step 0): the run stops where it
  saves, and resumes there."""

  class Late(loop.Stopper):
    reads = 0

    @property
    def received(self):  # the signal lands right after the first step's first look
      Late.reads += 1
      return None if Late.reads == 1 else signal.SIGINT

    @received.setter
    def received(self, value):
      pass

  monkeypatch.setattr(loop, "Stopper", Late)
  directory = tmp_path / "run"
  common = ["--steps", "3", "--batch", "8", "--seq-len", "32", "--checkpoint-dir",
            str(directory), "--no-compilation-cache"]
  code, err = main_err(capsys, *common)
  stopped = int(re.search(r"stopped at step (\d+) by SIGINT; saved", err).group(1))
  assert code == 128 + signal.SIGINT and sorted(os.listdir(directory)) == [str(stopped)], err
  monkeypatch.undo()
  code, err = main_err(capsys, *common)
  assert code == 0 and f"resumed at step {stopped}" in err, err


def test_another_configs_checkpoints_are_refused_and_kept(tmp_path, capsys):
  directory = tmp_path / "run"
  common = ["--steps", "4", "--warmup", "1", "--batch", "8", "--seq-len", "32",
            "--checkpoint-dir", str(directory), "--checkpoint-every", "2"]
  assert train.main(common) == 0
  before = {p: p.stat().st_mtime_ns for p in directory.rglob("*")}
  code, err = main_err(capsys, *common[:-4], "--learning-rate", "0.01", *common[-4:])
  assert code == 2
  assert "written by another config; nothing was changed" in err
  assert "train.learning_rate: 0.003 there, 0.01 here" in err
  assert {p: p.stat().st_mtime_ns for p in directory.rglob("*")} == before


def test_a_mesh_that_does_not_divide_the_model_is_refused_before_anything_is_written(
    tmp_path, capsys, monkeypatch):
  """Six devices put fsdp 6 across the tiny model's width of 64: the CLI refuses it as a usage
  error naming the parameter, its dimension and the axis, before the checkpoint directory
  exists; the library's layout (llama.place) refuses it too."""
  if jax.device_count() < 8:
    pytest.skip("needs 8 devices")
  six = jax.devices()[:6]
  with pytest.raises(ValueError, match=r"dimension 2 \(embed, size 64\) is laid out over mesh "
                     r"axes \('fsdp',\) of size 3, which does not divide it"):
    train_step.init(llama.preset("tiny", max_len=32), hparams.TrainConfig(batch=6, seq_len=32),
               placement.mesh(1, devices=six[:3]))
  monkeypatch.setattr(placement, "all_devices", lambda: six)
  directory = tmp_path / "run"
  code, err = main_err(capsys, "--batch", "12", "--seq-len", "32", "--steps", "2",
                    "--checkpoint-dir", str(directory))
  assert code == 2, err
  assert ("--mesh data=1,fsdp=6,tensor=1,sequence=1 (6 devices): the model's" in err
          and "(embed, size 64) is laid out over mesh axes ('fsdp',) of size 6" in err), err
  assert not directory.exists()
  # Tensor parallelism over more devices than the tiny model's 2 kv heads.
  monkeypatch.setattr(placement, "all_devices", lambda: jax.devices()[:8])
  code, err = main_err(capsys, "--batch", "8", "--seq-len", "32", "--steps", "2", "--mesh",
                    "data=2,tensor=4", "--checkpoint-dir", str(directory))
  assert code == 2, err
  assert ("--mesh data=2,fsdp=1,tensor=4,sequence=1 (8 devices): the model's" in err
          and "(heads, size 2) is laid out over mesh axes ('tensor',) of size 4" in err), err
  # The sequence over more shards than --seq-len has positions for.
  code, err = main_err(capsys, "--batch", "8", "--seq-len", "30", "--steps", "2", "--mesh",
                    "fsdp=2,sequence=4", "--checkpoint-dir", str(directory))
  assert code == 2 and "--seq-len 30 must be a multiple of the sequence axis' 4 devices" in err
  assert not directory.exists()


def test_a_layout_that_does_not_fit_is_refused_before_anything_is_written(
    tmp_path, capsys, monkeypatch):
  """A device whose memory cannot hold its share of the parameters and the optimizer's state
  (a checkpoint restored onto too few devices, say): a usage error with the numbers and what
  to change, the checkpoint directory untouched; spread over more devices it fits."""
  directory = tmp_path / "run"
  assert train.main(["--steps", "2", "--warmup", "1", "--batch", "8", "--seq-len", "32",
                     "--checkpoint-dir", str(directory)]) == 0
  before = {p: p.stat().st_mtime_ns for p in directory.rglob("*")}
  monkeypatch.setattr(loop, "device_limit", lambda where: 1 << 20)  # 1 MiB a device
  monkeypatch.setattr(placement, "all_devices", lambda: jax.devices()[:1])
  code, err = main_err(capsys, "--steps", "4", "--warmup", "1", "--batch", "8", "--seq-len", "32",
                    "--checkpoint-dir", str(directory))
  assert code == 2, err
  assert re.search(r"--mesh data=1,fsdp=1,tensor=1,sequence=1 \(1 devices\): a device would "
                   r"hold \d+\.\d MiB of parameters and \d+\.\d MiB of optimizer state, more "
                   r"than its 1\.0 MiB; spread them over more devices", err), err
  assert {p: p.stat().st_mtime_ns for p in directory.rglob("*")} == before


def test_a_diverging_run_stops_and_keeps_its_last_good_checkpoint(tmp_path, capsys):
  directory = tmp_path / "run"
  common = ["--steps", "12", "--batch", "8", "--seq-len", "32", "--checkpoint-every", "4",
            "--checkpoint-dir", str(directory), "--no-compilation-cache"]
  assert train.main([*common[:1], "4", *common[2:]]) == 0  # 4 good steps, saved at 4
  capsys.readouterr()
  # The same run, trained on to 12 steps with a learning rate that blows up: refused (another
  # config) ...
  code, err = main_err(capsys, *common, "--learning-rate", "1e30")
  assert code == 2 and "learning_rate" in err
  # ... so in a fresh directory: the step that goes non-finite stops it, and no checkpoint
  # is written from there on.
  fresh = tmp_path / "fresh"
  code, err = main_err(capsys, *common[:-2], str(fresh), "--no-compilation-cache",
                    "--learning-rate", "1e30", "--clip", "1e30")
  assert code == 1 and "stopped at step" in err and "not finite" not in err
  assert "Try a lower --learning-rate" in err
  stopped = int(re.search(r"stopped at step (\d+)", err).group(1))
  steps = sorted(int(p.name) for p in fresh.iterdir() if p.name.isdigit())
  assert all(s < stopped for s in steps), (steps, stopped)


def test_a_finished_run_trains_on(tmp_path, capsys):
  # With --warmup left to its default, which follows --steps (a tenth: 1 at 10 steps, 2 at
  # 20): the run trains on with the warmup it was written with.
  directory = tmp_path / "run"
  common = ["--batch", "8", "--seq-len", "32", "--checkpoint-dir", str(directory),
            "--no-compilation-cache"]
  assert train.main(["--steps", "10", *common]) == 0
  first = capsys.readouterr()
  assert re.fullmatch(r"final loss \d+\.\d{4} at step 10 \(.*tokens/s\)\n", first.out)
  code, err = main_err(capsys, "--steps", "10", *common)
  assert code == 0 and "nothing to do" in err and "a larger --steps trains on" in err
  code = train.main(["--steps", "20", *common])
  captured = capsys.readouterr()
  assert code == 0 and "resumed at step 10" in captured.err, captured.err
  assert captured.out.startswith("final loss") and "at step 20" in captured.out
  # A warmup the user sets is compared as before.
  code, err = main_err(capsys, "--steps", "24", "--warmup", "3", *common)
  assert code == 2 and "train.warmup: 1 there, 3 here" in err, err
