"""Datasets held as in-memory tensors, client partitioners (METHODS §1.4) and batch augmentation."""

from nestling.data.augment import AUGMENT_KINDS, augment_batch
from nestling.data.bundle import DatasetBundle, TensorData, stratified_sample
from nestling.data.datasets import KNOWN_DATASETS, describe_bundle, load_dataset
from nestling.data.dirichlet import dirichlet_balance_trick, dirichlet_balanced, scalefl_chunks
from nestling.data.partition import (
    KNOWN_SCHEMES,
    iid,
    make_partition,
    match_label_distribution,
    mean_label_entropy,
    partition_summary,
    shards,
    unbalanced,
)

__all__ = [
    "AUGMENT_KINDS",
    "KNOWN_DATASETS",
    "KNOWN_SCHEMES",
    "DatasetBundle",
    "TensorData",
    "augment_batch",
    "describe_bundle",
    "dirichlet_balance_trick",
    "dirichlet_balanced",
    "iid",
    "load_dataset",
    "make_partition",
    "match_label_distribution",
    "mean_label_entropy",
    "partition_summary",
    "scalefl_chunks",
    "shards",
    "stratified_sample",
    "unbalanced",
]
