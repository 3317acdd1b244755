"""Operator actions on a storage root, and a running server's figures read back from a scrape.

What ``persisting inspect | drop | compact | stats`` do, as plain functions returning
dataclasses; the command line only renders them. One module per action: :mod:`.inventory`
(inspect), :mod:`.maintenance` (drop, compact), :mod:`.stats` (figures). Reading
(inspect, stats) never changes anything: it lists directories and reads records, whatever
the settings of the process that asks.
"""

from persisting.admin.inventory import (
    BucketInfo,
    ModelInfo,
    RootInfo,
    TopicInfo,
    inspect_bucket,
    inspect_items,
    inspect_model,
    inspect_root,
)
from persisting.admin.maintenance import (
    CompactionResult,
    CompactionTarget,
    DropResult,
    compact_dataset,
    compaction_targets,
    drop_model,
    refuse_live,
)
from persisting.admin.root import KV_METADATA, open_root
from persisting.admin.stats import (
    Latency,
    ModelFigures,
    StatsReport,
    figures_from_scrape,
    figures_from_stats,
    histogram_quantile,
    model_stats,
    root_stats,
    scrape,
)

__all__ = [
    "KV_METADATA",
    "BucketInfo",
    "CompactionResult",
    "CompactionTarget",
    "DropResult",
    "Latency",
    "ModelFigures",
    "ModelInfo",
    "RootInfo",
    "StatsReport",
    "TopicInfo",
    "compact_dataset",
    "compaction_targets",
    "drop_model",
    "figures_from_scrape",
    "figures_from_stats",
    "histogram_quantile",
    "inspect_bucket",
    "inspect_items",
    "inspect_model",
    "inspect_root",
    "model_stats",
    "open_root",
    "refuse_live",
    "root_stats",
    "scrape",
]
