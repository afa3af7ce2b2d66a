"""docs/data.md "Data that outgrows one machine": make prepare and StreamingDataModule, in one process (DDP:
tests/test_streaming_ddp.py).

- The README's s3:// commands as typed (make prepare, then make train for one epoch) against moto's S3 server,
  started here on 127.0.0.1.
- The local path in-process: prepare's splits against a direct count of the folder, every validation and test
  sample seen by the LightningModule exactly once (under Lightning, with two loader workers and partial batches),
  the training order reshuffled per epoch, and re-runs of prepare (complete, interrupted, other settings,
  foreign output).
- The digits as `make prepare` writes them by default: a resume from an epoch's end is exact, 2 ranks' shares
  change every epoch, and a damaged split (deleted or truncated chunk, overwritten header, no index.json; in the
  store, no index.json) stops the run before it starts, naming the file and the fix.
"""

import hashlib
import json
import os
import shlex
import socket
import subprocess
from collections import Counter
from pathlib import Path

import lightning  # noqa: F401 - at collection: its log handler keeps the sys.stderr of its first import, which a capsys test closes
import pytest
import torch

from project.__main__ import main as project_main
from project.errors import ConfigError
from tests.conftest import LAUNCH_TIMEOUT, user_checkout, user_environment
from tests.test_readme import ONE_EPOCH, make_argv, readme_command, trained_in_process, write_images

pytestmark = pytest.mark.slow

PREPARE_S3 = "make prepare SOURCE=imagefolder ROOT=/data/pets OUTPUT=s3://my-bucket/pets IMAGE_SIZE=64"
TRAIN_S3 = (
    'make train ARGS="--data project.data.StreamingDataModule --data.init_args.input_dir s3://my-bucket/pets"'
)
PREPARE_LOCAL = "make prepare SOURCE=imagefolder ROOT=/data/pets OUTPUT=/data/pets-stream IMAGE_SIZE=64"
TRAIN_LOCAL = (
    'make train ARGS="--data project.data.StreamingDataModule --data.init_args.input_dir /data/pets-stream"'
)
# write_images: 2 classes x 50 images, no val/test folders. stratified_split holds out ceil(fraction * n):
# test ceil(0.2 * 100) = 20, val ceil(0.1 * 80) = 8, train 72 (one batch of the default 64).
EXPECTED = {"train": 72, "val": 8, "test": 20}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def s3(tmp_path_factory):
    """moto's S3 server on 127.0.0.1 with an empty bucket `my-bucket`; yields the AWS_* variables that reach it."""
    from moto.server import ThreadedMotoServer

    port = free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    env = {
        "AWS_ENDPOINT_URL": f"http://127.0.0.1:{port}",
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_DEFAULT_REGION": "us-east-1",
        # chunks downloaded for training: not in the user's ~/.lightning
        "LITDATA_CACHE_DIR": str(tmp_path_factory.mktemp("litdata-cache")),
    }
    import boto3

    boto3.client(
        "s3",
        endpoint_url=env["AWS_ENDPOINT_URL"],
        aws_access_key_id="testing",
        aws_secret_access_key="testing",
        region_name="us-east-1",
    ).create_bucket(Bucket="my-bucket")
    yield env
    server.stop()


@pytest.mark.claim("stream-s3-compatible")
@pytest.mark.timeout(LAUNCH_TIMEOUT + 120)
def test_readme_s3_commands(tmp_path, s3, monkeypatch, capsys):
    """make prepare to s3:// then make train from it, as the README types them (one epoch), each in this process
    (the command `make -n` prints for the README line: a new interpreter's seconds of imports saved). Both know
    the store from the AWS_* variables only."""
    checkout = user_checkout(tmp_path / "checkout")
    pets = write_images(tmp_path / "pets")
    argv = make_argv(readme_command(PREPARE_S3).replace("/data/pets", str(pets)))
    printed = subprocess.run(
        ["make", "-n", *argv[1:]],
        cwd=checkout,
        capture_output=True,
        text=True,
        check=True,
        env=user_environment(),  # not `make test`'s MAKEFLAGS (its ARGS would reach this make)
    )
    python, *command = shlex.split(printed.stdout.strip().splitlines()[-1])
    assert command[:3] == ["-m", "project", "prepare"], printed.stdout
    for name, value in s3.items():
        monkeypatch.setenv(name, value)
    # litdata reads LITDATA_CACHE_DIR once, when first imported (in this process, maybe by an earlier test)
    import litdata.utilities.dataset_utilities as litdata_paths

    monkeypatch.setattr(litdata_paths, "_LITDATA_CACHE_DIR", s3["LITDATA_CACHE_DIR"])
    project_main(command[2:])
    assert "Progress" in capsys.readouterr().err  # litdata's progress bar
    run = trained_in_process(readme_command(TRAIN_S3), checkout, *ONE_EPOCH)
    ckpt = torch.load(run / "checkpoints/last.ckpt", weights_only=True)
    (data,) = [v for k, v in ckpt.items() if k.endswith("StreamingDataModule")]
    # the image module's keys, which predict and export read (project/inference.py)
    assert data["class_names"] == ["cat", "dog"] and data["input_shape"] == [3, 64, 64], data
    assert len(data["mean"]) == len(data["std"]) == 3, data
    # Lightning kept the training loader's position (litdata's state): the epoch's one batch (72 // 64) read
    (loader,) = ckpt["loops"]["fit_loop"]["state_dict"]["combined_loader"]
    assert loader["current_epoch"] == 1 and loader["num_samples_yielded"] == 64, loader
    # the chunks came from the server into the cache, not from a local path
    cached = [p for p in Path(s3["LITDATA_CACHE_DIR"]).rglob("chunk-*.bin")]
    assert cached, list(Path(s3["LITDATA_CACHE_DIR"]).rglob("*"))

    # The store's train/index.json deleted: the run stops before it starts (exit code 2, nothing written), naming
    # the file and the prepare command that writes the dataset again.
    import boto3

    from tests.conftest import QUIET, run_cli
    from tests.test_bad_input import files_under

    store = boto3.client("s3", endpoint_url=s3["AWS_ENDPOINT_URL"], region_name="us-east-1")
    store.delete_object(Bucket="my-bucket", Key="pets/train/index.json")
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    monkeypatch.chdir(cwd)
    capsys.readouterr()
    data = ["--data", "project.data.StreamingDataModule", "--data.init_args.input_dir", "s3://my-bucket/pets"]
    assert run_cli("fit", *QUIET, *data) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert "'s3://my-bucket/pets/train/index.json' is missing" in err and "--overwrite true" in err, err
    assert not files_under(cwd), files_under(cwd)


# ----------------------------------------------------------------------------------------------------- local
def prepare_local(pets: Path, out: Path, *extra: str) -> None:
    """The README's local `make prepare` line, in this process (the command `make prepare` prints)."""
    from project.prepare import main

    assert readme_command(PREPARE_LOCAL)
    main(
        [
            "--source",
            "imagefolder",
            "--root",
            str(pets),
            "--output_dir",
            str(out),
            "--image_size",
            "64",
            *extra,
        ]
    )


@pytest.fixture(scope="module")
def local(tmp_path_factory):
    base = tmp_path_factory.mktemp("stream-local")
    pets = write_images(base / "pets")
    out = base / "pets-stream"
    prepare_local(pets, out)
    return pets, out


def stored(out: Path, split: str) -> Counter:
    """Every sample of a split read back straight from its chunks: (label, pixel hash) -> count."""
    from litdata import StreamingDataset

    ds = StreamingDataset(str(out / split))
    return Counter(_key(ds[i]["image"], ds[i]["label"]) for i in range(len(ds)))


def _key(pixels: torch.Tensor, label) -> tuple[int, str]:
    return int(label), hashlib.sha1(pixels.contiguous().numpy().tobytes()).hexdigest()


@pytest.mark.claim("stream-eval-exactly-once")
def test_val_and_test_count_every_sample_once(local):
    """Under Lightning, 2 loader workers, batch 3 (partial batches in every worker): the samples the module saw in
    validation and test are exactly the stored ones, each once."""
    import lightning as L

    from project.data import StreamingDataModule
    from project.models.convnet import ConvNet
    from project.module import ClassificationModule

    pets, out = local
    meta_counts = __import__("json").loads((out / "prepare.json").read_text())["splits"]
    assert meta_counts == EXPECTED
    # the same split sizes as the image module on the same folder and seed
    from project.data import ImageClassificationDataModule

    image = ImageClassificationDataModule("imagefolder", str(pets), image_size=64)
    image.setup("fit")
    assert {k: len(getattr(image, f"{k}_set")) for k in EXPECTED} == EXPECTED

    dm = StreamingDataModule(str(out), batch_size=3, num_workers=2)
    mean = torch.tensor(dm.mean).view(1, -1, 1, 1)
    std = torch.tensor(dm.std).view(1, -1, 1, 1)
    seen: dict[str, Counter] = {"val": Counter(), "test": Counter()}

    class Seen(L.Callback):
        def _count(self, stage, batch):
            x, y = batch
            pixels = ((x.cpu() * std + mean) * 255).round().to(torch.uint8)  # undo the normalisation exactly
            seen[stage].update(_key(p, label) for p, label in zip(pixels, y.tolist()))

        def on_validation_batch_end(self, trainer, pl_module, outputs, batch, batch_idx, dataloader_idx=0):
            if not trainer.sanity_checking:
                self._count("val", batch)

        def on_test_batch_end(self, trainer, pl_module, outputs, batch, batch_idx, dataloader_idx=0):
            self._count("test", batch)

    model = ClassificationModule(ConvNet(num_classes=2, in_channels=3, width=4), 2, dm.input_shape)
    trainer = L.Trainer(
        max_epochs=1,
        limit_train_batches=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[Seen()],
        accelerator="cpu",
    )
    trainer.fit(model, dm)
    trainer.test(model, dm, verbose=False)
    for split in ("val", "test"):
        assert sum(seen[split].values()) == EXPECTED[split], (split, seen[split])
        assert seen[split] == stored(out, split), split


@pytest.mark.claim("stream-reshuffled-per-epoch")
def test_training_order_reshuffled_per_epoch(local):
    """Two epochs of the training loader: each the same samples (72 // 8 = 9 full batches, the remainder 0), in
    a different order."""
    from project.data import StreamingDataModule

    _, out = local
    loader = StreamingDataModule(str(out), batch_size=8, num_workers=0).train_dataloader()
    epochs = [[_key(p, y) for b in loader for p, y in zip(b["image"], b["label"].tolist())] for _ in range(2)]
    assert len(epochs[0]) == len(epochs[1]) == 72
    assert Counter(epochs[0]) == Counter(epochs[1]) == stored(out, "train")
    assert epochs[0] != epochs[1]


@pytest.mark.claim("prepare-rerun-safe")
def test_prepare_rerun(tmp_path, local, capsys):
    """Complete output is kept, an interrupted split rewritten, other settings and foreign output refused."""
    import shutil

    from project.data import StreamingDataModule

    pets, done = local
    out = tmp_path / "pets-stream"
    shutil.copytree(done, out)
    train_index = out / "train/index.json"
    before = {p: p.stat().st_mtime_ns for p in out.rglob("*") if p.is_file()}

    prepare_local(pets, out)  # complete: nothing written
    assert "nothing to do" in capsys.readouterr().err
    assert {p: p.stat().st_mtime_ns for p in out.rglob("*") if p.is_file()} == before

    # interrupted while writing val: its chunks are there, its index.json is not (litdata writes it last)
    (out / "val/index.json").unlink()
    meta = out / "prepare.json"
    meta.write_text(meta.read_text().replace('"complete": true', '"complete": false'))
    with pytest.raises(ConfigError, match="Run the same prepare command again"):
        StreamingDataModule(str(out))
    prepare_local(pets, out)
    err = capsys.readouterr().err
    assert "val: writing 8 samples" in err, err
    assert (
        "train: complete (72 samples), kept." in err and train_index.stat().st_mtime_ns == before[train_index]
    )
    assert stored(out, "val") == stored(done, "val")
    assert StreamingDataModule(str(out)).meta["splits"] == EXPECTED

    with pytest.raises(ConfigError, match=r"other settings \(image_size: 64 -> 32\).*--overwrite true"):
        prepare_local(pets, out, "--image_size", "32")
    foreign = tmp_path / "foreign"
    (foreign / "train").mkdir(parents=True)
    (foreign / "train/mine.txt").write_text("not litdata")
    with pytest.raises(ConfigError, match="not written by `python -m project prepare`"):
        prepare_local(pets, foreign)
    assert os.listdir(foreign / "train") == ["mine.txt"]


@pytest.mark.claim("stream-resume-next-epoch")
def test_state_after_any_batch_resumes_exactly_then_whole_epochs(local):
    """A state taken after any batch of an epoch (its last included) resumes with exactly the batches that
    followed, then the same next two epochs (litdata 0.2.76 alone gave an empty next epoch here, with no loader
    worker). Batches are taken as Lightning takes them: len(loader) per epoch, never running the generator out."""
    from project.data import StreamingDataModule

    _, out = local
    dm = StreamingDataModule(str(out), batch_size=8, num_workers=0)

    def take(loader, n: int) -> list[list[tuple]]:
        it = iter(loader)
        return [
            [_key(p, y) for p, y in zip(b["image"], b["label"].tolist())]
            for b in (next(it) for _ in range(n))
        ]

    ref = dm.train_dataloader()
    assert len(ref) == 9
    epochs = [take(ref, 9) for _ in range(3)]
    assert epochs[0] != epochs[1] != epochs[2]
    for p in (2, 5, 9):
        a = dm.train_dataloader()
        head = take(a, p)
        b = dm.train_dataloader()
        b.load_state_dict(a.state_dict())
        assert head + take(b, 9 - p) == epochs[0], p
        assert take(b, 9) == epochs[1] and take(b, 9) == epochs[2], p


# ----------------------------------------------------------------------------------------- digits, default prepare
@pytest.fixture(scope="module")
def digits(tmp_path_factory) -> Path:
    """The digits as `make prepare` writes them by default (SOURCE=digits, no other argument)."""
    from tests.conftest import run_cli

    out = tmp_path_factory.mktemp("digits") / "digits-stream"
    assert run_cli("prepare", "--source", "digits", "--output_dir", out) == 0
    return out


@pytest.mark.claim("stream-resume-epoch-end")
def test_resume_from_an_epoch_end_is_exact(digits, tmp_path):
    """A finished 1-epoch run resumed with max_epochs 2 ends with the weights of an uninterrupted 2-epoch run, bit
    for bit. Lightning does not restore the loader's state from a checkpoint taken at an epoch's end; the loader
    takes the epoch from the trainer, so the resumed epoch reads epoch 1's order, not epoch 0's again. The same
    checkpoint as a kill right after an epoch ends (tests/tools/kill_resume_streaming.py kills there too). A constant
    learning rate: the default schedule's length depends on max_epochs."""
    import importlib.util

    from tests.conftest import CONFIGS, QUIET, REPO, run_cli

    spec = importlib.util.spec_from_file_location("kill_resume", REPO / "tests/tools/kill_resume.py")
    kill_resume = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(kill_resume)

    def fit(run: str, epochs: int, *extra: str) -> None:
        args = ["fit", "--config", CONFIGS / "default.yaml", *QUIET, "--trainer.max_epochs", epochs]
        args += ["--data", "project.data.StreamingDataModule", "--data.init_args.input_dir", digits]
        args += ["--data.init_args.batch_size", "64", "--data.init_args.num_workers", "1"]
        args += ["--model.init_args.scheduler", "null", "--trainer.limit_val_batches", "1"]
        assert run_cli(*args, "--test_after_fit", "false", "--run_dir", tmp_path / run, *extra) == 0

    fit("reference", 2)
    fit("resumed", 1)
    ckpt = torch.load(tmp_path / "resumed/checkpoints/last.ckpt", weights_only=True)
    (loader,) = ckpt["loops"]["fit_loop"]["state_dict"]["combined_loader"]
    # the epoch's end (litdata counts epochs from 1): Lightning does not restore it, the trainer's epoch decides
    assert loader["current_epoch"] == 1 and loader["num_samples_yielded"] == 20 * 64, loader
    fit("resumed", 2, "--ckpt_path", "last")
    problems = kill_resume.compare(tmp_path / "reference", tmp_path / "resumed")
    assert problems == [], problems


@pytest.mark.claim("stream-shards-change-per-epoch")
def test_default_prepare_shards_change_every_epoch(digits):
    """With the chunks `make prepare` writes by default, each of 2 DDP ranks reads another share of the training
    split every epoch, and no sample is left out of two epochs. The ranks are computed in this process:
    each rank's StreamingDataset told it is rank r of 2 (litdata's _DistributedEnv), as DDP would tell it."""
    from litdata.utilities.env import _DistributedEnv

    from project.data import StreamingDataModule
    from project.data.chunks import MIN_CHUNKS
    from tests.streaming_probe import sample_key

    for split in ("train", "val", "test"):
        index = json.loads((digits / split / "index.json").read_text())
        assert len(index["chunks"]) >= MIN_CHUNKS, (split, len(index["chunks"]))

    def epochs(rank: int, n: int = 3) -> list[Counter]:
        loader = StreamingDataModule(str(digits), batch_size=32, num_workers=0).train_dataloader()
        loader.dataset.distributed_env = _DistributedEnv(2, rank, 1)
        return [
            Counter(sample_key(p, y) for b in loader for p, y in zip(b["image"], b["label"].tolist()))
            for _ in range(n)
        ]

    from litdata import StreamingDataset

    stored = Counter(sample_key(s["image"], s["label"]) for s in StreamingDataset(str(digits / "train")))
    ranks = [epochs(0), epochs(1)]
    for e in range(3):
        assert [sum(r[e].values()) for r in ranks] == [640, 640]  # 20 batches of 32 each (README)
        assert ranks[0][e] + ranks[1][e] <= stored  # disjoint
    # Any two of the 3 epochs: with 2 chunks a rank has only 2 possible shares and the remainder 2 possible tails,
    # so some pair of epochs would repeat one.
    for a, b in ((0, 1), (0, 2), (1, 2)):
        for r in ranks:
            assert r[a] != r[b], f"a rank read the same share in epochs {a} and {b}"
        seen = ranks[0][a] + ranks[1][a] + ranks[0][b] + ranks[1][b]
        assert set(stored) <= set(seen), (
            f"{len(set(stored) - set(seen))} samples left out of epochs {a} and {b}"
        )


def _delete_chunk(split: Path) -> Path:
    chunk = sorted(split.glob("chunk-*.bin"))[3]
    chunk.unlink()
    return chunk


def _truncate_chunk(split: Path) -> Path:
    chunk = sorted(split.glob("chunk-*.bin"))[3]
    chunk.write_bytes(chunk.read_bytes()[:100])
    return chunk


def _overwrite_header(split: Path) -> Path:
    chunk = sorted(split.glob("chunk-*.bin"))[3]
    with open(chunk, "r+b") as f:
        f.write(b"\xde\xad\xbe\xef" * 4)  # the same size: only the header says it is damaged
    return chunk


def _delete_index(split: Path) -> Path:
    index = split / "index.json"
    index.unlink()
    return index


@pytest.mark.claim("stream-bad-chunks")
@pytest.mark.parametrize("damage", [_delete_chunk, _delete_index, _truncate_chunk, _overwrite_header])
def test_damaged_split_is_one_paragraph_and_no_run_dir(digits, damage, in_tmp, capsys):
    """A deleted chunk file, a missing index.json, a truncated chunk or one whose header was overwritten: the run
    stops before it starts (exit code 2, no run directory), naming the file and the prepare command that fixes it."""
    import shutil

    from tests.test_bad_input import fails

    data = in_tmp / "digits-stream"
    shutil.copytree(digits, data)
    bad = damage(data / "train")
    err = fails(capsys, "--data", "project.data.StreamingDataModule", "--data.init_args.input_dir", str(data))
    assert str(bad) in err and "python -m project prepare --source digits" in err, err
    assert f"--output_dir {data} --overwrite true" in err, err


def test_data_layer_does_not_import_prepare():
    """prepare is a command on top of project/data (the format is project/data/chunks.py): no module of the data
    layer imports it."""
    import ast

    from tests.conftest import REPO

    for path in sorted((REPO / "project/data").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            if isinstance(node, ast.ImportFrom):
                names = [node.module or ""] + [f"{node.module}.{a.name}" for a in node.names]
            assert not any(n == "project.prepare" or n.startswith("project.prepare.") for n in names), path


@pytest.mark.claim("stream-resume-epoch-end")
def test_training_loader_reads_the_trainers_epoch(local):
    """Given the trainer's epoch, each iter() reads that epoch's order, whatever the loader read before."""
    from types import SimpleNamespace

    from project.data import StreamingDataModule

    _, out = local
    dm = StreamingDataModule(str(out), batch_size=3, num_workers=0)

    def one_epoch(loader) -> list:
        it = iter(loader)
        return [
            _key(p, y) for b in (next(it) for _ in range(len(loader))) for p, y in zip(b["image"], b["label"])
        ]

    counted = dm.train_dataloader()  # no trainer: litdata's own count of epochs
    orders = [one_epoch(counted) for _ in range(4)]
    assert len({tuple(o) for o in orders}) == 4
    dm.trainer = SimpleNamespace(current_epoch=2, num_devices=1, world_size=1)
    loader = dm.train_dataloader()
    assert one_epoch(loader) == orders[2]  # a fresh loader at epoch 2 (a resume from an epoch's end)
    dm.trainer.current_epoch = 1
    assert one_epoch(loader) == orders[1]


@pytest.mark.claim("resume-same-data")
def test_resume_onto_re_prepared_data_stops(tmp_path, capsys):
    """A streaming run, its data prepared again with another split_seed: the resume stops with one paragraph
    (before, it trained on and reported test_acc 1.0 on a test split whose images it had trained on)."""
    from tests.conftest import CONFIGS, QUIET, run_cli

    out = tmp_path / "digits-stream"
    prepare = ["prepare", "--source", "digits", "--output_dir", out, "--overwrite", "true"]
    fit = ["fit", "--config", CONFIGS / "default.yaml", *QUIET, "--data", "project.data.StreamingDataModule"]
    fit += [
        "--data.init_args.input_dir",
        out,
        "--data.init_args.num_workers",
        "0",
        "--run_dir",
        tmp_path / "run",
    ]
    fit += [
        "--trainer.limit_train_batches",
        "3",
        "--trainer.limit_val_batches",
        "1",
        "--test_after_fit",
        "false",
    ]
    assert run_cli(*prepare) == 0 and run_cli(*fit, "--trainer.max_epochs", "1") == 0
    assert run_cli(*prepare, "--split_seed", "1") == 0
    capsys.readouterr()
    assert run_cli(*fit, "--trainer.max_epochs", "2", "--ckpt_path", "last") == 2
    err = capsys.readouterr().err
    assert "samples in the train/val/test splits" in err and "--run_dir" in err, err
