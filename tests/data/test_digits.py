import pytest
import torch

from project.data import ImageClassificationDataModule


def setup_dm(**kwargs) -> ImageClassificationDataModule:
    dm = ImageClassificationDataModule(**kwargs)
    dm.setup("fit")
    return dm


def labels_of(dataset) -> torch.Tensor:
    return dataset.labels


@pytest.mark.claim("digits-test-split")
def test_digits_splits_are_stratified_disjoint_and_complete():
    from project.data.digits import load_digits_tensors

    dm = setup_dm()
    sizes = [len(dm.train_set), len(dm.val_set), len(dm.test_set)]
    assert sum(sizes) == 1797 and sizes[2] == 360  # test = ceil(20%)
    # Stratified: test is drawn from all 1,797 images, val from the other 1,437; each class gets its proportional
    # share of the split, rounded (largest remainders), so it is less than one image away from exact.
    counts = {
        n: torch.bincount(labels_of(ds), minlength=10).double()
        for n, ds in zip(("train", "val", "test"), (dm.train_set, dm.val_set, dm.test_set))
    }
    total, rest = counts["train"] + counts["val"] + counts["test"], counts["train"] + counts["val"]
    assert ((counts["test"] - 360 * total / 1797).abs() < 1).all()
    assert ((counts["val"] - sizes[1] * rest / rest.sum()).abs() < 1).all()
    # Disjoint and complete, by image: the file holds 1,797 distinct images (no exact duplicate, checked here), so
    # an image in two splits, or one missing, would change the count of distinct rows across the splits.
    images, _ = load_digits_tensors()
    distinct = torch.unique(images.flatten(1), dim=0)
    assert len(distinct) == 1797
    split_rows = torch.cat([ds.images.flatten(1) for ds in (dm.train_set, dm.val_set, dm.test_set)])
    assert torch.equal(torch.unique(split_rows, dim=0), distinct) and len(split_rows) == 1797


@pytest.mark.claim("digits-test-split")
def test_split_is_fixed_by_split_seed_not_the_training_seed():
    import lightning as L

    L.seed_everything(1)
    a = setup_dm(split_seed=0)
    L.seed_everything(2)
    b = setup_dm(split_seed=0)
    c = setup_dm(split_seed=1)
    assert torch.equal(a.test_set.images, b.test_set.images)
    assert not torch.equal(a.test_set.images, c.test_set.images)


def test_batches_are_float32_normalised_with_training_statistics():
    from project.data.digits import load_digits_tensors

    dm = setup_dm(augment="none")
    x, y = dm.on_after_batch_transfer(next(iter(dm.train_dataloader())), 0)
    assert x.dtype == torch.float32 and x.shape == (64, 1, 8, 8) and y.dtype == torch.int64
    all_train = dm.on_after_batch_transfer(dm.tensors["train"], 0)[0].double()
    # With the training split's own statistics the normalised split has mean 0 and std 1 exactly in real arithmetic
    # (both use torch's unbiased std). What float32 leaves is rounding: the stored mean is a float32 sum over 92k
    # values (~log2(92k) = 17 ulp) plus two rounded ops per pixel, |z| < 2: under 40 float32 epsilons (4.8e-6;
    # measured 4e-8). Statistics of all 1,797 images (test included) would miss by 2.5e-3, checked below.
    eps = torch.finfo(torch.float32).eps
    assert abs(all_train.mean().item()) < 40 * eps and abs(all_train.std().item() - 1) < 40 * eps
    raw = dm.train_set.images.double()
    every, _ = load_digits_tensors()
    assert abs(((raw - every.double().mean()) / every.double().std()).mean().item()) > 100 * eps
    assert dm.num_classes == 10 and dm.input_shape == (1, 8, 8) and dm.class_names[3] == "3"


def test_loader_settings():
    dm = setup_dm(in_memory=False)  # the DataLoader path (digits default to the in-memory loader)
    train, val = dm.train_dataloader(), dm.val_dataloader()
    assert train.drop_last and not val.drop_last
    assert train.num_workers == 0  # in-memory tensors: workers only cost (see default_num_workers)
    assert train.pin_memory == torch.cuda.is_available()
    dm2 = setup_dm(num_workers=2, in_memory=False)
    loader = dm2.train_dataloader()
    assert loader.num_workers == 2 and loader.persistent_workers and loader.prefetch_factor == 2


def test_state_dict_carries_classes_and_preprocessing():
    dm = setup_dm()
    state = dm.state_dict()
    assert state["class_names"] == [str(i) for i in range(10)] and len(state["mean"]) == 1
    assert state["input_shape"] == [1, 8, 8]


@pytest.mark.claim("digits-embedded")
def test_embedded_file_is_the_uci_digits_set():
    from project.data.digits import load_digits_tensors

    images, labels = load_digits_tensors()
    assert images.shape == (1797, 1, 8, 8) and images.dtype == torch.float32 and labels.dtype == torch.int64
    assert images.min() == 0 and images.max() == 1  # counts 0..16 scaled to [0, 1]
    assert torch.bincount(labels).tolist() == [178, 182, 177, 183, 181, 182, 181, 179, 174, 180]
    assert labels[:10].tolist() == list(range(10))  # the file's first rows are 0, 1, ..., 9


def test_stratified_split_counts_seeds_and_errors():
    import pytest

    from project.data.splits import stratified_split

    labels = torch.arange(10).repeat_interleave(torch.tensor([30, 30, 30, 30, 30, 30, 30, 30, 30, 21]))
    rest, held = stratified_split(labels, 0.2, seed=0)
    assert len(held) == 59 and sorted(rest + held) == list(range(len(labels)))  # ceil(0.2 * 291), a partition
    per_class = torch.bincount(labels[held], minlength=10)
    assert per_class[:9].tolist() == [6] * 9 and per_class[9] == 5  # 6.08 each, 4.26: the leftover goes to 9
    assert stratified_split(labels, 0.2, seed=0) == (rest, held)
    assert stratified_split(labels, 0.2, seed=1)[1] != held
    assert stratified_split(labels, 0.0, seed=0) == (list(range(len(labels))), [])
    with pytest.raises(ValueError, match="at least 2 per class"):
        stratified_split([0, 0, 1, 2, 2], 0.4, seed=0)
    with pytest.raises(ValueError, match="fewer samples than the 3 classes"):
        stratified_split([0, 0, 1, 1, 2, 2], 0.2, seed=0)


@pytest.mark.claim("bad-input-batch-size")
def test_prepare_data_loads_and_checks_the_data():
    """Lightning creates the loggers' files between prepare_data and setup: bad data must fail in prepare_data.
    (The CLI also removes a run directory without checkpoints, which hides a check moved to setup.)"""
    from project.errors import ConfigError

    with pytest.raises(ConfigError, match="fewer than data.batch_size=5000"):
        ImageClassificationDataModule(batch_size=5000).prepare_data()


@pytest.mark.claim("eval-never-augmented")
def test_in_memory_evaluation_batches_are_never_augmented(tmp_path):
    """The digits default (tensors on the device, affine augmentation): in a real fit, every validation batch the
    model sees is the val split, in order, normalised and nothing else."""
    import lightning as L

    from project.data.normalize import normalize
    from project.models import ConvNet
    from project.module import ClassificationModule

    class Record(L.Callback):
        def __init__(self) -> None:
            self.val, self.train = [], []

        def on_validation_batch_start(self, trainer, pl_module, batch, batch_idx, dataloader_idx=0) -> None:
            self.val.append(batch[0].clone())

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
            self.train.append(batch[0].clone())

    dm, record = ImageClassificationDataModule(batch_size=32), Record()
    assert dm.hparams.in_memory and dm.recipe == "affine"
    trainer = L.Trainer(
        max_epochs=2,
        limit_train_batches=2,
        num_sanity_val_steps=0,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=tmp_path,
        callbacks=[record],
    )
    trainer.fit(ClassificationModule(ConvNet(10, width=4), 10, (1, 8, 8)), datamodule=dm)
    x, _ = dm.tensors["val"]
    stats = [torch.tensor(v).view(-1, 1, 1) for v in (dm.mean, dm.std)]
    expected = normalize(x, *stats)
    assert len(record.val) == 2 * 5  # two validations of 144 images in batches of 32
    for val in (record.val[:5], record.val[5:]):
        assert torch.equal(torch.cat(val), expected)
    # ... while training batches of the same fit are augmented (the recipe is on)
    first = torch.cat([x for x, _ in dm.train_dataloader()])[:32]
    assert not torch.equal(record.train[0], normalize(first, *stats))


@pytest.mark.claim("resume-same-data")
def test_a_resume_onto_other_splits_stops_with_the_fix():
    """The in-memory default, another split_seed: other samples in each split (and other statistics)."""
    from project.errors import ConfigError

    state = setup_dm().state_dict()
    assert state["fingerprint"] and state["mean"]
    setup_dm().load_state_dict(state)  # the same data: the run goes on
    with pytest.raises(
        ConfigError, match=r"statistics, the samples in the train/val/test splits .*--run_dir"
    ):
        setup_dm(split_seed=1).load_state_dict(state)
    # any Dataset too: its carved splits
    from project.data import DatasetDataModule
    from project.data.sequences import DigitPixelSequences

    sequences = [DatasetDataModule(DigitPixelSequences(), split_seed=s) for s in (0, 1)]
    for dm in sequences:
        dm.setup("fit")
    with pytest.raises(ConfigError, match=r"samples in the train/val/test splits"):
        sequences[1].load_state_dict(sequences[0].state_dict())
