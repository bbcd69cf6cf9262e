"""``consolidate(src, dst)`` and the ``lightning-parallel consolidate IN OUT`` command: any supported checkpoint to
one weights-only Lightning file that ``MyModule.load_from_checkpoint(OUT)`` loads on one device."""

from __future__ import annotations

import argparse
import errno
import os
import sys
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

from .atomic import check_writable_file, disk_errors
from .errors import CheckpointFormatError
from .formats import CheckpointInfo, detect_format
from .names import RESUMED_FROM_KEY
from .read import DROPPED_KEYS, read_checkpoint
from .verify import verify_folder

__all__ = ["ConsolidateResult", "consolidate", "main"]


@dataclass(frozen=True)
class ConsolidateResult:
    """What :func:`consolidate` wrote.

    Attributes:
        source: the detected source checkpoint.
        output: the file written.
        tensors: tensors in the written ``state_dict``.
        parameters: their elements (parameters and buffers; tied weights counted once per name).
        bytes: their bytes (the file adds Lightning's other keys and framing).
        dropped: the top-level keys of the source left out (``optimizer_states`` and ``lr_schedulers`` where it had
            them; an lp_sharded folder keeps its optimizer shards in the rank files, DeepSpeed in its own files).
    """

    source: CheckpointInfo
    output: Path
    tensors: int
    parameters: int
    bytes: int
    dropped: tuple[str, ...]
    resumable: bool = False

    def summary(self) -> str:
        """One line: what was read, what was written."""
        tail = ("optimizer state (one-device form), LR schedulers and loop position kept: Trainer.fit(ckpt_path=OUT) "
                "resumes on one device or under any strategy" if self.resumable
                else "optimizer and LR-scheduler states dropped (weights-only checkpoint)")
        return (f"consolidated {self.source.path} [{self.source.describe()}] -> {self.output}: {self.tensors} tensors, "
                f"{self.parameters:,} parameters, {self.bytes:,} bytes; {tail}")


def consolidate(src: str | Path, dst: str | Path, *, trusted: bool = False, resumable: bool = False,
                overwrite: bool = False) -> ConsolidateResult:
    """Write the one-file, single-device Lightning checkpoint of ``src`` (any supported format) to ``dst``.

    The file holds ``state_dict`` with the LightningModule's own names (full tensors, as trained; DeepSpeed: fp32
    masters) and the source's other top-level Lightning keys (``hyper_parameters``, ``epoch``, ``global_step``,
    ``loops``, ``callbacks``, ...), so ``MyModule.load_from_checkpoint(dst)`` works on one device. **Optimizer and
    LR-scheduler states are dropped** (``optimizer_states``, ``lr_schedulers``): the result is a weights-only
    checkpoint, like Lightning's ``save_weights_only`` (``Trainer.fit(ckpt_path=dst)`` refuses to resume from it).
    Everything in it loads with ``torch.load(weights_only=True)``.

    ``resumable=True`` keeps what a fit needs to continue: the optimizer state joined into the one-device per-index
    form, the LR schedulers and the loops (:func:`~lightning_parallel.checkpoint.resume.read_resumable`), so
    ``Trainer.fit(ckpt_path=dst)`` resumes on one device with any Lightning strategy, or under any of the library's
    layouts (a one-file checkpoint from a one-device run is also the starting point of a sharded one as it is).

    ``dst`` is written atomically (a temporary file in its folder, then renamed); missing parent folders are
    created; ``dst`` may not be ``src`` itself or an existing folder, and an existing file is replaced only with
    ``overwrite``. The destination is checked before the source is read (a large checkpoint is not joined for a path
    that cannot be written). ``trusted``: see :func:`full_state_dict`. Raises :class:`CheckpointFormatError` for an
    unreadable source, ``OSError`` for an unwritable destination (``FileExistsError`` for an existing file without
    ``overwrite``).
    """
    source, out = Path(src), Path(dst)
    if out.exists() and out.is_dir():
        raise IsADirectoryError(errno.EISDIR, "the output is an existing folder; give a file path for the checkpoint",
                                str(out))
    if source.exists() and out.exists() and out.resolve() == source.resolve():
        raise CheckpointFormatError(f"{out}: the output is the input checkpoint itself; write it to another file.")
    if source.is_dir() and source.resolve() in out.resolve().parents:
        beside = source.resolve().parent / f"{source.name.removesuffix('.ckpt')}_consolidated.ckpt"
        raise CheckpointFormatError(
            f"{out}: the output is inside the input checkpoint folder {source}; a file added there is not one of the "
            "files the save wrote, so the folder would be refused afterwards (its checksum list no longer matches). "
            f"Write it outside the folder (e.g. {beside}).")
    if out.exists() and not overwrite:
        raise FileExistsError(errno.EEXIST, "the file exists; pass --force (overwrite=True) to replace it", str(out))
    check_writable_file(out)
    if source.is_dir():  # against its checksum list (a DCP folder without one is refused); a file when it is read
        verify_folder(source)
    if resumable:
        from .resume import read_resumable

        checkpoint = read_resumable(source, trusted=trusted)
        checkpoint.pop(RESUMED_FROM_KEY, None)
        info = detect_format(source, trusted=trusted)
        if not checkpoint.get("optimizer_states"):
            raise CheckpointFormatError(f"{source}: holds no optimizer state (a weights-only checkpoint); there is "
                                        "nothing to resume. Drop --resumable to write its weights.")
        checkpoint["state_dict"] = {k: _own_storage(v) for k, v in checkpoint["state_dict"].items()}
        rest = checkpoint
    else:
        state, rest, info = read_checkpoint(source, trusted=trusted)
        checkpoint = {k: v for k, v in rest.items() if k not in DROPPED_KEYS}
        checkpoint["state_dict"] = {k: _own_storage(v) for k, v in state.items()}
    tensors = [v for v in checkpoint["state_dict"].values() if isinstance(v, Tensor)]
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.tmp{os.getpid()}")
    try:
        with disk_errors(out, needed=sum(t.numel() * t.element_size() for t in tensors)):
            torch.save(checkpoint, tmp)
            os.replace(tmp, out)
    except RuntimeError as err:  # torch's writer: "File ... cannot be opened" and the like
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise OSError(errno.EIO, first, str(out)) from err
    finally:
        if tmp.exists():
            tmp.unlink()
    return ConsolidateResult(
        source=info, output=out, tensors=len(tensors), parameters=sum(t.numel() for t in tensors),
        bytes=sum(t.numel() * t.element_size() for t in tensors),
        dropped=() if resumable else tuple(k for k in DROPPED_KEYS if k in rest), resumable=resumable,
    )


def _own_storage(value: object) -> object:
    """A tensor that owns exactly its bytes (a view into a larger buffer would save the whole buffer)."""
    if isinstance(value, Tensor):
        value = value.detach().cpu()
        if value.untyped_storage().nbytes() != value.numel() * value.element_size() or not value.is_contiguous():
            value = value.clone(memory_format=torch.contiguous_format)
    return value


_DESCRIPTION = (
    "Convert a checkpoint written under any lightning-parallel strategy (a Lightning file from lp_ddp, lp_dp or "
    "lp_sharded checkpoint='full'; an lp_sharded checkpoint='sharded' folder; an lp_tensor, lp_pipeline or lp_hybrid "
    "distributed-checkpoint folder; an lp_zero_offload DeepSpeed folder, CPU or NVMe offload) into one Lightning "
    "checkpoint file that MyModule.load_from_checkpoint(OUT) loads on one "
    "device. The format is detected from the files. Optimizer and LR-scheduler states are dropped (a weights-only "
    "checkpoint); weights, hyper_parameters and Lightning's other keys are kept."
)
_EPILOG = ("Exit status: 0 written, 1 the input could not be read or the output not written (the reason is printed; "
           "an existing OUT needs --force), 2 bad arguments.")


def main(argv: list[str] | None = None) -> int:
    """``lightning-parallel consolidate IN OUT [--trust]``: one summary line; an error is one line and exit 1."""
    parser = argparse.ArgumentParser(prog="lightning-parallel consolidate", description=_DESCRIPTION, epilog=_EPILOG)
    parser.add_argument("input", metavar="IN", help="checkpoint file or folder written by trainer.save_checkpoint")
    parser.add_argument("output", metavar="OUT", help="the one-file checkpoint to write (e.g. model.ckpt)")
    parser.add_argument("--trust", action="store_true",
                        help="load a Lightning file or an lp_sharded folder with torch.load(weights_only=False), "
                             "which runs code stored in the files: only for files you trust (needed when they hold "
                             "pickled objects; DeepSpeed folders are always read that way)")
    parser.add_argument("--force", action="store_true", help="replace OUT if it exists (without it, an existing "
                        "OUT is refused)")
    parser.add_argument("--resumable", action="store_true",
                        help="keep the optimizer state (joined into the one-device form), LR schedulers and loop "
                             "position, so that Trainer.fit(ckpt_path=OUT) resumes on one device or under any "
                             "layout (DeepSpeed folders excepted)")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():  # DeepSpeed's own choice without a GPU, minus the warning it prints on stdout
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    try:
        result = consolidate(args.input, args.output, trusted=args.trust, resumable=args.resumable,
                             overwrite=args.force)
    except CheckpointFormatError as err:
        print(f"lightning-parallel consolidate: error: {err}", file=sys.stderr)
        return 1
    except OSError as err:
        where = f" ({err.filename})" if err.filename and str(err.filename) != str(args.output) else ""
        print(f"lightning-parallel consolidate: error: cannot write {args.output}: {err.strerror or err}{where}",
              file=sys.stderr)
        return 1
    print(result.summary())
    return 0
