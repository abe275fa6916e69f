"""What a task's tests install with apt (:mod:`sequester.verifier.apt_pins`): read, never run."""

from __future__ import annotations

from sequester.verifier.apt_pins import AptRequest, apt_requests, apt_requests_of_tests


def test_install_lines_of_a_script_with_wrappers_options_and_continuations():
    script = (
        "apt-get update\n"
        "apt-get install -y curl primer3\n"
        "sudo DEBIAN_FRONTEND=noninteractive apt-get -o Dpkg::Options::=--force-confold install \\\n"
        "    --no-install-recommends gcc libgl1:amd64 && echo done\n"
        "apt install -y $EXTRA 'lib*' vim=2:9.1\n"
        "apt-get remove -y nano\n"
        "echo apt-get install -y not-a-command\n"
    )
    got = apt_requests(script)
    assert got.packages == ("curl", "primer3", "gcc", "libgl1:amd64", "vim=2:9.1")
    assert got.not_literal == ("$EXTRA", "lib*")
    assert got.no_recommends and not got.reinstall


def test_reinstall_and_what_the_runner_provides():
    got = apt_requests("apt install -y --reinstall texlive-latex-base curl\n")
    assert got.reinstall
    assert got.without({"curl"}) == AptRequest(("texlive-latex-base",), (), False, True)


def test_the_scripts_the_tests_write_are_read_too(tmp_path):
    (tmp_path / "test.sh").write_text("apt-get install -y curl expect\n")
    (tmp_path / "test_outputs.py").write_text(
        'SETUP = """\nset -e\nDEBIAN_FRONTEND=noninteractive apt-get install -y git openssh-client\n"""\n'
        "os.system('apt install -y --reinstall texlive-latex-base')\n"
        'subprocess.run("apt-get install -y jq", shell=True)\n'
    )
    (tmp_path / "data.bin").write_bytes(b"\0apt-get install -y never")
    (tmp_path / "link.sh").symlink_to("/etc/passwd")
    got = apt_requests_of_tests(tmp_path)
    assert got.packages == ("curl", "expect", "git", "openssh-client", "texlive-latex-base", "jq")
    assert got.reinstall


def test_a_script_without_apt_asks_for_nothing(tmp_path):
    (tmp_path / "test.sh").write_text("uvx -p 3.13 -w pytest==8.4.1 pytest /tests\n")
    assert apt_requests_of_tests(tmp_path) == AptRequest()
