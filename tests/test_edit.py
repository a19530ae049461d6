"""`localspec.edit` helpers without a model: fences, line endings, range splice,
refusal of binary input, atomic writes (including SIGKILL between write and rename)."""

from __future__ import annotations

import os
import signal
import stat
import subprocess
import sys
import textwrap

import pytest

from localspec.core.errors import UsageError
from localspec.edit import (
    FenceReader,
    build_messages,
    choose_fence,
    decode_text,
    detect_newline,
    extract_fenced,
    parse_lines,
    read_source,
    split_lines,
    split_region,
    unified_diff,
    write_atomic,
)

# ----- fences ---------------------------------------------------------------------------


def test_extract_plain_block():
    assert extract_fenced("```python\nx = 1\ny = 2\n```\n") == "x = 1\ny = 2"


def test_extract_ignores_chatter_around_the_block():
    reply = "Here is the file:\n\n```py\na\n```\nI renamed it.\n```\nb\n```\n"
    assert extract_fenced(reply) == "a"


def test_extract_closing_fence_without_newline_at_the_end():
    assert extract_fenced("```\nabc\n```") == "abc"


def test_extract_empty_body():
    assert extract_fenced("```\n```\n") == ""


def test_unclosed_block_is_none():
    assert extract_fenced("```python\nx = 1\n") is None
    assert extract_fenced("```python\nx = 1\n``") is None
    assert extract_fenced("no block at all") is None


def test_closing_line_must_be_only_the_fence():
    # "```python" inside a body is not a closing fence; "```  " is
    assert extract_fenced("```\na\n```python\nb\n```  \n") == "a\n```python\nb"


def test_reader_done_only_when_the_closing_line_is_complete():
    reader = FenceReader("```")
    for piece in ["```js\n", "let a", " = 1;\n", "``", "`"]:
        assert not reader.feed(piece)
    assert reader.feed("\n")
    assert reader.body == "let a = 1;"
    reader.feed("more text after the block")  # ignored once done
    assert reader.finish() == "let a = 1;"


def test_reader_accepts_fence_at_end_of_stream():
    reader = FenceReader("```")
    reader.feed("```\nx\n```")
    assert not reader.done  # the line could still continue ("```python")
    assert reader.finish() == "x"


def test_longer_fence_when_the_text_has_fences():
    md = "# Title\n\n```python\nprint(1)\n```\n"
    fence = choose_fence(md)
    assert fence == "````"
    reply = f"{fence}markdown\n{md.rstrip()}\n{fence}\n"
    assert extract_fenced(reply, fence) == md.rstrip()
    assert choose_fence("plain text") == "```"


def test_crlf_reply_is_normalised():
    assert extract_fenced("```\r\na\r\nb\r\n```\r\n") == "a\nb"


def test_messages_carry_file_name_range_and_fence():
    region = split_region("a\nb\nc\n", 2, 3)
    msgs = build_messages(region, "src/x.py", 3, "do it", region.body)
    user = msgs[-1]["content"]
    assert "x.py, lines 2-3 of 3" in user and "```python\nb\nc\n```" in user and "do it" in user


# ----- line endings, final newline, ranges ------------------------------------------------


@pytest.mark.parametrize("text,nl", [("a\nb\n", "\n"), ("a\r\nb\r\n", "\r\n"), ("", "\n"),
                                     ("a\r\nb\r\nc\n", "\r\n"), ("a\nb\nc\r\n", "\n")])
def test_detect_newline(text, nl):
    assert detect_newline(text) == nl


def test_crlf_round_trip_keeps_crlf():
    text = "one\r\ntwo\r\nthree\r\n"
    region = split_region(text)
    assert region.body == "one\ntwo\nthree"
    assert region.join("one\nTWO\nthree") == "one\r\nTWO\r\nthree\r\n"


@pytest.mark.parametrize("text", ["x = 1\ny = 2", "x = 1\ny = 2\n", "x = 1\ny = 2\n\n\n"])
def test_final_newline_kept_whatever_the_model_does(text):
    region = split_region(text)
    trail = text[len(text.rstrip("\n")):]
    for reply in ("x = 1\ny = 3", "x = 1\ny = 3\n", "x = 1\ny = 3\n\n\n\n"):
        assert region.join(reply) == "x = 1\ny = 3" + trail


def test_identical_body_is_unchanged_and_joins_byte_for_byte():
    text = "a\r\nb\nc"  # mixed endings: untouched when nothing changed
    region = split_region(text)
    assert region.unchanged("a\nb\nc\n")
    assert region.join("a\nb\nc") == text


def test_range_splice_keeps_the_rest_byte_for_byte():
    text = "l1\r\nl2\r\nl3\r\nl4\r\nl5"
    region = split_region(text, 2, 3)
    assert (region.head, region.body, region.tail) == ("l1\r\n", "l2\nl3", "l4\r\nl5")
    assert region.join("L2\nL2b\nL3\n") == "l1\r\nL2\r\nL2b\r\nL3\r\nl4\r\nl5"


def test_range_at_end_without_final_newline():
    region = split_region("a\nb\nc", 2, None)
    assert region.newlines == 0
    assert region.join("B\nC\n") == "a\nB\nC"


def test_range_may_delete_its_lines():
    region = split_region("a\nb\nc\n", 2, 2)
    assert region.join("") == "a\nc\n"
    assert split_region("only\n").join("\n") == ""


def test_lines_split_at_newlines_only():
    assert split_lines("a\fb\r\nc\n\nd") == ["a\fb\r\n", "c\n", "\n", "d"]
    assert split_lines("") == [] and split_lines("x\n") == ["x\n"]
    region = split_region("a\fb\nc\n", 2, 2)  # a form feed does not start a line
    assert (region.head, region.body) == ("a\fb\n", "c")


@pytest.mark.parametrize("spec,expected", [("3:7", (3, 7)), ("3-7", (3, 7)), ("5:", (5, None)),
                                           (":9", (None, 9)), (" 2 : 2 ", (2, 2))])
def test_parse_lines(spec, expected):
    assert parse_lines(spec) == expected


@pytest.mark.parametrize("spec", ["", ":", "a:b", "0:3", "7:3", "1:2:3"])
def test_parse_lines_rejects(spec):
    with pytest.raises(UsageError):
        parse_lines(spec)


def test_range_beyond_the_file_is_an_error():
    with pytest.raises(UsageError, match="only 3 lines"):
        split_region("a\nb\nc\n", 2, 9)
    with pytest.raises(UsageError, match="only 3 lines"):
        split_region("a\nb\nc\n", 4, None)


# ----- reading ----------------------------------------------------------------------------


def test_binary_and_non_utf8_refused(tmp_path):
    with pytest.raises(UsageError, match="binary"):
        decode_text(b"\x89PNG\r\n\x1a\n\0\0", "img.png")
    with pytest.raises(UsageError, match="not UTF-8.*offset 3"):
        decode_text(b"abc\xff\xfe", "latin.txt")
    with pytest.raises(UsageError, match="not a regular file"):
        read_source(tmp_path)
    with pytest.raises(UsageError, match="No such file"):
        read_source(tmp_path / "missing.py")


def test_bom_is_kept(tmp_path):
    p = tmp_path / "bom.txt"
    p.write_bytes(b"\xef\xbb\xbfhello\n")
    src = read_source(p)
    assert src.text == "hello\n" and src.bom
    assert src.encode("bye\n") == b"\xef\xbb\xbfbye\n"


# ----- diff -------------------------------------------------------------------------------


def test_unified_diff_applies_with_git(tmp_path):
    old = "a\nb\nc\n"
    new = "a\nB\nc\nd"
    diff = unified_diff(old, new, "f.txt")
    assert diff.startswith("--- a/f.txt\n+++ b/f.txt\n") and "\\ No newline at end of file" in diff
    (tmp_path / "f.txt").write_text(old)
    (tmp_path / "p.diff").write_text(diff)
    subprocess.run(["git", "apply", "p.diff"], cwd=tmp_path, check=True)
    assert (tmp_path / "f.txt").read_text() == new


# ----- atomic writes ----------------------------------------------------------------------


def test_write_atomic_keeps_mode_and_leaves_no_temp(tmp_path):
    p = tmp_path / "run.sh"
    p.write_text("old\n")
    p.chmod(0o751)
    write_atomic(p, b"new\n")
    assert p.read_bytes() == b"new\n"
    assert stat.S_IMODE(p.stat().st_mode) == 0o751
    assert sorted(x.name for x in tmp_path.iterdir()) == ["run.sh"]


def test_write_atomic_follows_symlink(tmp_path):
    real = tmp_path / "real.txt"
    real.write_text("old")
    link = tmp_path / "link.txt"
    link.symlink_to(real)
    write_atomic(link, b"new")
    assert link.is_symlink() and real.read_text() == "new"


def test_failure_before_rename_keeps_original_and_cleans_up(tmp_path):
    p = tmp_path / "f.txt"
    p.write_text("original")

    def boom() -> None:
        raise RuntimeError("disk on fire")

    with pytest.raises(RuntimeError):
        write_atomic(p, b"new", before_replace=boom)
    assert p.read_text() == "original"
    assert [x.name for x in tmp_path.iterdir()] == ["f.txt"]


@pytest.mark.parametrize("moment", ["before_rename", "during_write"])
def test_sigkill_during_write_leaves_the_original(tmp_path, moment):
    """A real SIGKILL: between the fsynced temp file and the rename, or while a large
    temp file is being written. The original must be intact, byte for byte."""
    p = tmp_path / "data.txt"
    original = b"precious\r\n" * 1000
    p.write_bytes(original)
    code = textwrap.dedent(f"""
        import os, signal, threading
        from localspec.edit import write_atomic
        def kill():
            os.kill(os.getpid(), signal.SIGKILL)
        if {moment!r} == "during_write":
            threading.Timer(0.05, kill).start()
            while True:
                write_atomic({str(p)!r}, b"x" * 50_000_000)
        write_atomic({str(p)!r}, b"new", before_replace=kill)
    """)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, timeout=120)
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    assert p.read_bytes() == original
    leftovers = [x for x in tmp_path.iterdir() if x.name != "data.txt"]
    assert all(x.name.startswith(".data.txt.") and x.name.endswith(".tmp") for x in leftovers)


def test_new_output_file_gets_requested_mode(tmp_path):
    out = tmp_path / "out.py"
    write_atomic(out, b"x", 0o700)
    assert stat.S_IMODE(out.stat().st_mode) == 0o700
    os.chmod(out, 0o644)


def test_a_repeated_opening_fence_is_dropped():
    from localspec.edit import _drop_repeated_fence

    assert _drop_repeated_fence("```python\nx = 1", "```") == "x = 1"
    assert _drop_repeated_fence("x = 1", "```") == "x = 1"
    assert _drop_repeated_fence("```python\nx", "````") == "```python\nx"  # a markdown body's own
    assert _drop_repeated_fence(None, "```") is None
