"""A prompt row's images as plain data: which columns hold them and what identifies them.

The vision plug-in (`cohort.vision`) loads and encodes them; the data layer only needs to tell rows apart
(the eval/train overlap check), so these two helpers live here, below it.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from typing import Any

IMAGE_COLUMNS = ("image", "images")


def row_images(row: Mapping[str, Any]) -> list[Any]:
    """The row's image values (not yet loaded): [] without image columns."""
    if row.get("images") is not None:
        value = row["images"]
        return list(value) if isinstance(value, list | tuple) else [value]
    if row.get("image") is not None:
        return [row["image"]]
    return []


def images_key(row: Mapping[str, Any]) -> str:
    """What identifies a row's images when comparing rows (eval/train overlap): paths as written, the sha1
    of an in-memory image's pixels or of its bytes; "" for a row without images."""
    from PIL import Image  # optional: only rows with images reach here (the vision extra)

    parts = []
    for value in row_images(row):
        if isinstance(value, Image.Image):
            parts.append(hashlib.sha1(value.tobytes() + repr((value.size, value.mode)).encode()).hexdigest())
        elif isinstance(value, bytes | bytearray):
            parts.append(hashlib.sha1(value).hexdigest())
        elif isinstance(value, Mapping):
            data = value.get("bytes")
            parts.append(hashlib.sha1(data).hexdigest() if data else str(value.get("path")))
        else:
            parts.append(str(value))
    return "|".join(parts)
