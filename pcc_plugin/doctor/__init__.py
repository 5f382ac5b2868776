"""`pcc-device-plugin doctor`: the troubleshooting table, run as checks against this node.

Given the daemon's flags, it checks what the daemon needs and what kubelet sees: the
device nodes and directories (under --host-root), kubelet's socket directory,
kubelet.sock, the daemon's own socket and /readyz. It prints one line per check,
PASS, WARN (works, but not as it should; with the fix), FAIL (with the fix) or
SKIP (not applicable, or waiting on a failed check), and exits 0 only when
nothing failed.

It changes nothing: kubelet gets no Register (that would replace the daemon's
registration), only a call to a method it does not serve; the daemon gets the
calls kubelet makes, and a ListAndWatch stream that ends after its first message.

    cli.py        flags, the order of the checks, the summary and exit code
    report.py     a check's result and the shared "is it the right kind of file" check
    node.py       device nodes and the directories mounted into containers; for the PCC
                  profile, symlinks; a TEE device's identity (SEV-SNP, TDX, TPM)
    attestation.py  the hardware of a profile's onlyOn, configfs-tsm, a TPM's event log
    mountinfo.py  which mount holds a path, for the read-only diagnosis
    kubelet.py    kubelet's socket directory, kubelet.sock, the daemon's socket
    readyz.py     the daemon's /readyz
    config.py     whether the daemon runs the --config file as it is now
    http.py       the small HTTP client those two use
"""
