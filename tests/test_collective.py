"""How a data-parallel job decides that an error is everyone's (pytrain/step/distributed.py),
without MPI: a stand-in world whose collectives return what the other ranks would have sent.
tests/test_distributed.py runs the same paths under mpiexec."""
import pytest

from pytrain.errors import PytrainError
from pytrain.step.distributed import (CollectiveError, World, agree, forget_messages,
                                       keep_message, on_main)


class Rank(World):
    """Rank ``rank`` of ``size``; ``others`` is what the other ranks contribute to a gather
    (by rank), ``root`` what rank 0 broadcasts."""

    def __init__(self, rank, size, others=None, root=None):
        super().__init__()
        self.rank, self.size, self.others, self.root = rank, size, others or {}, root
        self.host = "h"
        self.barriers = 0

    def allgather(self, obj):
        return [obj if r == self.rank else self.others[r] for r in range(self.size)]

    def bcast(self, obj):
        return obj if self.rank == 0 else self.root

    def barrier(self):
        self.barriers += 1


def test_a_failure_on_another_rank_reaches_this_one_as_a_collective_error():
    """Rank 0 succeeded, rank 1 could not read a file: rank 0 learns it from the gather,
    raises the same error naming rank 1, and releases what it had opened."""
    released = []
    w = Rank(0, 2, others={1: ("rank 1 on h", "data.jsonl: cannot read dataset")})
    with pytest.raises(CollectiveError, match=r"^rank 1 on h: data.jsonl: cannot read dataset$"):
        agree(w, lambda: "session", undo=released.append)
    assert released == ["session"]


def test_the_same_error_on_every_rank_is_said_once_without_rank_names():
    w = Rank(1, 2, others={0: ("rank 0 on h", "config.toml: bad key")})

    def fail():
        raise PytrainError("config.toml: bad key")
    with pytest.raises(CollectiveError, match=r"^config.toml: bad key$"):
        agree(w, fail)


def test_different_errors_are_each_named_with_their_ranks():
    w = Rank(0, 3, others={1: ("rank 1 on h", "b"), 2: ("rank 2 on h", "a")})

    def fail():
        raise OSError("a")
    with pytest.raises(CollectiveError) as e:
        agree(w, fail)
    assert str(e.value) == "rank 0 on h, rank 2 on h: a; rank 1 on h: b"


def test_a_bug_is_not_agreed_but_left_to_abort():
    """Only input errors (PytrainError, OSError) are gathered: anything else propagates on
    this rank (the command line aborts the job with its traceback)."""
    w = Rank(0, 2, others={1: ("rank 1 on h", None)})
    with pytest.raises(ZeroDivisionError):
        agree(w, lambda: 1 / 0)


def test_one_process_keeps_the_error_as_it_was():
    class Own(PytrainError):
        pass

    def fail():
        raise Own("x")
    with pytest.raises(Own):
        agree(World(), fail)
    with pytest.raises(Own):
        on_main(World(), fail)


def test_rank_0s_failure_is_raised_on_every_rank():
    with pytest.raises(CollectiveError, match="^in use$"):
        on_main(Rank(1, 2, root=("error", "in use")), lambda: pytest.fail("rank 1 ran it"))
    assert on_main(Rank(1, 2, root=("ok", 7)), lambda: pytest.fail("rank 1 ran it")) == 7


def test_the_message_is_kept_in_the_run_folder_and_said_once(tmp_path, capsys):
    out = tmp_path / "run"
    for rank in (0, 1):
        w = Rank(rank, 2)
        assert w.end_together("error: they differ", 1, out) == 1
        assert w.barriers == 1                  # nobody leaves before rank 0 has said it
    err = capsys.readouterr().err
    assert err == f"error: they differ (also in {out / 'error.log'})\n"
    assert (out / "error.log").read_text().endswith(" error: they differ\n")
    forget_messages(out)
    assert not (out / "error.log").exists()


def test_a_folder_that_cannot_hold_the_message_is_said_so(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    said = keep_message(blocker / "run", "error.log", "m")
    assert said.startswith(f" (could not also write it to {blocker / 'run' / 'error.log'}: ")
    assert keep_message(None, "error.log", "m") == ""
