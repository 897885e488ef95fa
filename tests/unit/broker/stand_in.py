"""What the broker node reads of its Raft group's replicated metadata, for the unit tests' stand-in groups."""

from __future__ import annotations

from typing import Any


class MetadataReads:
    """``DLedgerGroup``'s metadata reads over ``self.tables`` (table -> {key: value}): ``metadata`` a copy,
    ``metadata_view`` the table itself, ``metadata_get`` one key."""

    tables: dict[str, dict[str, Any]]

    def metadata(self, table: str) -> dict[str, Any]:
        return dict(self.tables.get(table, {}))

    def metadata_view(self, table: str) -> dict[str, Any]:
        return self.tables.get(table, {})

    def metadata_get(self, table: str, key: str, default: Any = None) -> Any:
        return self.tables.get(table, {}).get(key, default)
