"""Engine KV events: decoding (``decode``), applying them to the KV-block index (``apply``), and the
ingestion thread with its ZMQ subscribers, sequence tracking and replay (``service``)."""

from epp.kvevents.apply import EventApplier
from epp.kvevents.decode import DecodeError, EventBatch, decode_batch
from epp.kvevents.service import KVEventsIngester, Target

__all__ = ["DecodeError", "EventApplier", "EventBatch", "KVEventsIngester", "Target", "decode_batch"]
