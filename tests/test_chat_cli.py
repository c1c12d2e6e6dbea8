"""`python -m optimum_qnn chat` driven through a pseudo-terminal: two turns, /reset, Ctrl-C during a reply, /exit."""

from __future__ import annotations

import fcntl
import os
import re
import select
import subprocess
import sys
import termios
import time

from tests.conftest import FP16_CTX, REPO_ROOT, child_env


class Terminal:
    """A child process on a pseudo-terminal that is its controlling terminal (so Ctrl-C is a SIGINT)."""

    def __init__(self, args: list[str]):
        master, slave = os.openpty()

        def own_terminal():
            os.setsid()
            fcntl.ioctl(0, termios.TIOCSCTTY, 0)

        self.proc = subprocess.Popen(args, stdin=slave, stdout=slave, stderr=slave, cwd=REPO_ROOT, env=child_env(),
                                     preexec_fn=own_terminal, close_fds=True)
        os.close(slave)
        self.master = master
        self.seen, self.pos = "", 0

    def expect(self, pattern: str, timeout: float = 180) -> str:
        """Read until ``pattern`` (a regex) appears after the previous match; returns the text up to its end."""
        deadline = time.monotonic() + timeout
        while not (m := re.search(pattern, self.seen[self.pos:])):
            left = deadline - time.monotonic()
            assert left > 0, f"no {pattern!r} in:\n{self.seen[self.pos:][-3000:]}"
            ready, _, _ = select.select([self.master], [], [], left)
            if ready:
                try:
                    chunk = os.read(self.master, 4096).decode("utf-8", errors="replace")
                except OSError:  # the child closed the terminal
                    chunk = ""
                assert chunk or self.proc.poll() is None, f"the chat exited ({self.proc.poll()}):\n{self.seen[-3000:]}"
                self.seen += chunk
        out = self.seen[self.pos : self.pos + m.end()]
        self.pos += m.end()
        return out

    def send(self, text: str) -> None:
        os.write(self.master, text.encode())

    def close(self) -> int:
        try:
            return self.proc.wait(timeout=60)
        finally:
            os.close(self.master)


def test_chat_in_a_terminal(fp16_export):
    # 16 new tokens a reply: the second turn (about 55 tokens of prompt plus the first reply) and its reply's reserve
    # fit the context of 96 without dropping the first turn, and a reply lasts long enough to be stopped by Ctrl-C.
    term = Terminal([sys.executable, "-m", "optimum_qnn", "chat", str(fp16_export.output), "--max-new-tokens", "16", "-v"])
    try:
        banner = term.expect(r"> $")
        assert "Chat with" in banner and "SM8650" in banner and f"context {FP16_CTX}" in banner and "/reset" in banner
        term.send("for\n")
        first = term.expect(r"\]\r?\n> $")
        assert re.search(r"\[\d+ prompt tokens \(0 reused\) \+ \d+ new", first), first
        term.send("if x:\n")
        second = term.expect(r"\]\r?\n> $")
        reused = int(re.search(r"prompt tokens \((\d+) reused\)", second).group(1))
        assert reused > 10 and "dropped" not in second, second  # the first turn's tokens were not read again
        term.send("/reset\n")
        assert "starts over" in term.expect(r"> $")
        # A long reply, stopped by Ctrl-C once its first words are out: the session stays and answers again.
        term.send("/exit_not_a_command\n")
        assert "Unknown command" in term.expect(r"> $")
        term.send("while\n")
        term.expect(r"while\r?\n\s*\S")  # the reply's first text is out (it may begin with a newline)
        term.send("\x03")
        stopped = term.expect(r"\]\r?\n> $")
        assert "(stopped)" in stopped and "stopped by cancelled" in stopped, stopped
        term.send("hello\n")
        assert "prompt tokens" in term.expect(r"\]\r?\n> $")
        term.send("/exit\n")
        assert term.close() == 0
    finally:
        if term.proc.poll() is None:
            term.proc.kill()


def test_chat_without_verbose_prints_only_the_conversation(fp16_export):
    """Piped input works too (a script feeding the chat), and without -v nothing of the libraries shows."""
    proc = subprocess.run(
        [sys.executable, "-m", "optimum_qnn", "chat", str(fp16_export.output), "--max-new-tokens", "4"],
        input="for\n/reset\n/exit\n", capture_output=True, text=True, cwd=REPO_ROOT, env=child_env(), timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    assert lines[0].startswith("Chat with") and "starts over" in proc.stdout
    assert "[INFO]" not in proc.stdout + proc.stderr and "prompt tokens" not in proc.stdout
    assert proc.stderr.strip() == "", proc.stderr
