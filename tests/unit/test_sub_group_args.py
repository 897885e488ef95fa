"""``raftmq admin update-sub-group`` and ``sub-group-list``'s argument checks: a bad value exits 2 with one line
naming it, before anything is sent (``--namesrv`` points at a closed port, so a value that slipped through would
end in exit 1 instead)."""

from __future__ import annotations

import pytest

from raftmq.cli import main

CLOSED = "127.0.0.1:1"


@pytest.mark.parametrize("args, named", [
    (["update-sub-group", "-g", "G", "-s", "maybe"], "argument --consume-enable/-s: must be true or false, got "
                                                     "'maybe'"),
    (["update-sub-group", "-g", "G", "--retry-queue-nums", "0"], "--retry-queue-nums must be within 1..1024, got 0"),
    (["update-sub-group", "-g", "G", "-r", "-1"], "--retry-max-times must be within 0..2147483647, got -1"),
    (["update-sub-group", "-g", "G", "-r", "x"], "argument --retry-max-times/-r: invalid int value: 'x'"),
    (["update-sub-group", "-s", "false"], "the following arguments are required: -g/--group"),
    (["update-sub-group", "-g", "bad group", "-s", "false"], "--group 'bad group' contains illegal characters"),
    (["sub-group-list", "-g", "bad group"], "--group 'bad group' contains illegal characters"),
    (["update-sub-group", "-g", "G", "--broker", "b a"], "--broker 'b a'"),
])
def test_a_bad_argument_exits_2_naming_it(args, named, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["admin", "--namesrv", CLOSED, "--timeout", "2", *args])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and named in err, err


@pytest.mark.parametrize("args", [["update-sub-group", "-g", "G", "-s", "FALSE", "-r", "3"],
                                  ["sub-group-list"], ["sub-group-list", "-g", "G", "--broker", "broker-a"]])
def test_good_arguments_get_as_far_as_the_name_servers(args, capsys):
    code = main(["admin", "--namesrv", CLOSED, "--timeout", "2", *args])
    assert code == 1
    assert "could not connect to 127.0.0.1:1" in capsys.readouterr().err
