"""The relay of a rank's output drops the C++ stack of torch's c10d warnings and says one site's at most once every
NativeWarnings.every_s (a rank whose store went away repeats them at every call: megabytes in minutes)."""

from __future__ import annotations

from ntp_megatron.launch.console import NativeWarnings

BROKEN = ("[rank2]:[W1207 21:34:35.047931505 TCPStore.cpp:106] [c10d] sendBytes failed on SocketImpl(fd=3, "
          "addr=[::ffff:127.0.0.1]:41434, remote=[::ffff:127.0.0.1]:45307): Broken pipe\n")
STACK = ["Exception raised from sendBytes at /__w/pytorch/pytorch/torch/csrc/distributed/c10d/Utils.hpp:758 (most "
         "recent call first):\n",
         "frame #0: c10::Error::Error(c10::SourceLocation, std::string) + 0x9d (0x7f6254579b8d in libc10.so)\n",
         "frame #1: c10d::TCPStore::add(std::string const&, long) + 0x8d (0x7f624614168d in libtorch_cpu.so)\n",
         "<omitting python frames>\n", "frame #28: <unknown function> + 0x2724a (0x7f625684524a in libc.so.6)\n", "\n"]
RESET = "[W1207 21:34:36.1 TCPStore.cpp:125] [c10d] recvValue failed on SocketImpl(fd=4): Connection reset by peer\n"


class Clock:
    now = 0.0

    def __call__(self) -> float:
        return self.now


def relayed(native: NativeWarnings, lines: list[str]) -> list[str]:
    return [kept for line in lines if (kept := native.keep(line)) is not None]


def test_a_warning_comes_without_its_stack_and_one_site_once_in_a_while():
    clock = Clock()
    native = NativeWarnings(clock)
    other = "iteration line\n"
    assert relayed(native, [BROKEN, *STACK, other]) == [BROKEN, other]
    clock.now += 1.0
    assert relayed(native, [BROKEN, *STACK, BROKEN, *STACK, RESET, *STACK, other]) == [RESET, other]
    clock.now += NativeWarnings.every_s
    assert relayed(native, [BROKEN, *STACK]) == [BROKEN.rstrip() + " (2 more from TCPStore.cpp:106 left out)\n"]


def test_other_lines_are_relayed_as_they_are():
    """Blank lines and frames that follow no c10d warning (a Python traceback quoting a C++ error) stay."""
    lines = ["Traceback (most recent call last):\n", "RuntimeError: boom\n", "frame #0: something\n", "\n"]
    assert relayed(NativeWarnings(Clock()), lines) == lines
