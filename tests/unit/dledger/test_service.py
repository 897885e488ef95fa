"""``DLedgerService``'s answers to malformed requests: INVALID_REQUEST, the remark and ext ``field`` naming it."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from dledger import ByteLog
from dledger.service import DLedgerService
from remoting.codec import make_request
from remoting.codes import RequestCode, ResponseCode


@pytest.fixture
def service(tmp_path):
    log = ByteLog(tmp_path / "byte.log")
    log.apply_batch(log.prepare_batch([b"a" * 100, b"b" * 100], 0, 1, fresh=True).payload, 1, 0)
    yield DLedgerService(SimpleNamespace(config=SimpleNamespace(group="g"), _sm=log))
    log.close()


@pytest.mark.parametrize("code, ext, field", [
    (RequestCode.GET_RAFT_STATUS, {}, "group"),
    (RequestCode.FETCH_COMMIT_LOG, {"group": "other", "phy_offset": 0, "max_bytes": 1}, "group"),
    (RequestCode.FETCH_COMMIT_LOG, {"group": "g", "phy_offset": -1, "max_bytes": 1}, "phy_offset"),
    (RequestCode.FETCH_COMMIT_LOG, {"group": "g", "phy_offset": 0, "max_bytes": 0}, "max_bytes"),
    (RequestCode.FETCH_COMMIT_LOG, {"group": "g", "phy_offset": 3, "max_bytes": 1}, "phy_offset"),  # in a record
    (RequestCode.FETCH_COMMIT_LOG, {"group": "g", "phy_offset": 10 ** 9, "max_bytes": 1}, "phy_offset"),
    (RequestCode.TRANSFER_LEADERSHIP, {"group": "g", "to": 7}, "to"),
    (RequestCode.TRANSFER_LEADERSHIP, {"group": "g", "to": "n1", "timeout_ms": 0}, "timeout_ms"),
])
async def test_a_malformed_field_is_named_in_remark_and_ext(service, code, ext, field):
    # ext.field, which remoting/codes.py promises for INVALID_REQUEST (and InvalidRequestError carries), was
    # never set: a client could only parse the remark.
    response = await service.handle(make_request(code, ext=ext), None)
    assert response.code == ResponseCode.INVALID_REQUEST, response
    assert response.ext.get("field") == field and field in response.remark, response
