"""Segmentation cases kept after their deterministic preprocessing (MONAI's CacheDataset): the
samples are the ones the uncached dataset gives for the same random state, each case is
prepared once however many epochs read it, and ``cache=`` bounds what is kept."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

pytest.importorskip("monai")

from bigbatch.segmentation.synthetic import write_brats_like, write_shapes_2d
from bigbatch.train.config import ConfigError, load_config
from bigbatch.train.tasks import task_for
from bigbatch.train.tasks.segmentation.cache import CachedCases, cache_budget
from bigbatch.train.tasks.segmentation.data import (
    SegDataset,
    VolumeRecipe,
    scan_segmentation,
)


def samples(dataset: object, seed: int, epochs: int = 2) -> list[tuple[torch.Tensor, ...]]:
    torch.manual_seed(seed)
    return [dataset[i] for _ in range(epochs) for i in range(len(dataset))]  # type: ignore[index, arg-type]


@pytest.fixture(scope="module")
def volumes(tmp_path_factory: pytest.TempPathFactory) -> object:
    data = write_brats_like(tmp_path_factory.mktemp("brats"), n=4)
    return scan_segmentation(data)


@pytest.mark.parametrize("train", [True, False])
@pytest.mark.parametrize("cache_num", [1, 4])
def test_cached_volumes_give_the_same_samples(volumes: object, train: bool, cache_num: int) -> None:
    recipe = VolumeRecipe(16, spacing=(1.0, 1.0, 1.0), multiple=8)
    plain = SegDataset(volumes, 16, train=train, augment=train, recipe=recipe)  # type: ignore[arg-type]
    cached = CachedCases(
        SegDataset(volumes, 16, train=train, augment=train, recipe=recipe),  # type: ignore[arg-type]
        cache_num,
    )
    for (x, y), (cx, cy) in zip(samples(plain, 3), samples(cached, 3), strict=True):
        assert torch.equal(x, cx) and torch.equal(y, cy)


def test_each_cached_case_is_prepared_once(tmp_path: Path) -> None:
    items = scan_segmentation(write_shapes_2d(tmp_path, n=5, size=16))
    dataset = SegDataset(items, 16, train=True, augment=True)
    calls: list[int] = []
    original = dataset.prepared

    def counted(i: int) -> object:
        calls.append(i)
        return original(i)

    dataset.prepared = counted  # type: ignore[method-assign]
    cached = CachedCases(dataset, 3)
    samples(cached, 0, epochs=3)
    # The 3 kept cases once (when the cache filled), the 2 others at every epoch.
    assert sorted(calls) == [0, 1, 2, 3, 3, 3, 4, 4, 4]


def test_cache_setting_is_parsed_and_checked(tmp_path: Path) -> None:
    assert cache_budget("none") == 0 and cache_budget("2MB") == 2_000_000
    assert cache_budget("auto") > 0
    data = write_shapes_2d(tmp_path, n=4, size=16)
    with pytest.raises(ConfigError, match="cache='lots': give auto, none or a size"):
        load_config(overrides=[f"data={data}", "task=segmentation", "cache=lots"])


@pytest.mark.parametrize(("setting", "kept"), [("auto", "4 of 4 training"), ("none", None)])
def test_the_task_keeps_what_the_budget_allows_and_says_so(
    tmp_path: Path, setting: str, kept: str | None
) -> None:
    data = write_shapes_2d(tmp_path, n=5, size=32)
    cfg = load_config(
        overrides=[
            f"data={data}",
            "task=segmentation",
            "size=32",
            "valid_pct=0.2",
            f"cache={setting}",
        ]
    )
    task = task_for(cfg)
    lines: list[str] = []
    train_items, valid_items = task.prepare(lines.append)
    train_set, valid_set = task.datasets(train_items, valid_items)
    if kept is None:
        assert isinstance(train_set, SegDataset) and not any("cache:" in line for line in lines)
    else:
        assert isinstance(train_set, CachedCases) and isinstance(valid_set, CachedCases)
        assert any(f"cache: {kept} and 1 of 1 validation" in line for line in lines)
