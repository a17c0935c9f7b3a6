"""What the services log never carries a credential, and what a job or client chose stays bounded.

``dlsched.kit.logs.RedactingFilter`` masks private key blocks (one without its END line to the
end), bearer tokens and ``token=``/``password:`` values, and cuts a message to
``MAX_LOG_CHARS`` (after masking: a key's BEGIN line may fall in the cut); the key scan is one pass (20,000 BEGIN lines without an END once took 55 s).
"""

from __future__ import annotations

import io
import logging

from dlsched.kit import logs

KEY = "-----BEGIN OPENSSH PRIVATE KEY-----\nb3BlbnNzaC1rZXktdjEAAAAA\n-----END OPENSSH PRIVATE KEY-----"


def _logged(msg: str, *args: object) -> str:
    out = io.StringIO()
    handler = logging.StreamHandler(out)
    handler.addFilter(logs.RedactingFilter())
    log = logging.getLogger("test-redaction")
    log.propagate = False
    log.addHandler(handler)
    try:
        log.warning(msg, *args)
    finally:
        log.removeHandler(handler)
    return out.getvalue()


def test_keys_tokens_and_passwords_are_masked() -> None:
    text = _logged("cluster %s: key %s then %s; auth Bearer abcdefghijklmnop, password: hunter22",
                   "c1", KEY, KEY.replace("OPENSSH", "RSA"))
    assert "b3BlbnNzaC1rZXkt" not in text and "abcdefghijklmnop" not in text and "hunter22" not in text
    assert text.count("[REDACTED]") == 4 and "cluster c1: key [REDACTED] then [REDACTED]" in text
    cut_key = _logged("the key: %s", KEY.split("\n-----END")[0])  # no END line: masked to the end
    assert "b3BlbnNz" not in cut_key and "the key: [REDACTED]" in cut_key


def test_what_a_job_or_client_chose_is_cut_and_scanned_once() -> None:
    text = _logged("state %r; the end", "x" * (logs.MAX_LOG_CHARS * 4))
    assert len(text) < logs.MAX_LOG_CHARS + 200 and "characters cut" in text and text.rstrip().endswith("the end")
    many = _logged("%s", "-----BEGIN RSA PRIVATE KEY-----" * 20000)
    assert many.strip() == "[REDACTED]"
    secret_after_cut = _logged("%s", "y" * logs.MAX_LOG_CHARS + KEY)
    assert "b3BlbnNz" not in secret_after_cut
    long_key = KEY.replace("b3BlbnNzaC1rZXktdjEAAAAA", "QUJD" * logs.MAX_LOG_CHARS)
    assert "QUJD" not in _logged("%s", "z" * logs.MAX_LOG_CHARS + long_key)  # its BEGIN line in the cut


def test_a_record_is_one_line_whatever_its_arguments_hold() -> None:
    """Control characters in a logged value (a percent-decoded path, a job's message) are
    escaped: a newline would start a forged record, a NUL makes the file binary to grep."""
    import logging

    from dlsched.kit.logs import RedactingFilter

    rec = logging.LogRecord("gateway", logging.INFO, __file__, 1, "GET %s -> %d",
                            ("/v1/jobs/x\n2026-12-06 INFO forged\r\x00\x1b[31m\u2028tab\tok é", 404), None)
    assert RedactingFilter().filter(rec)
    assert rec.getMessage() == "GET /v1/jobs/x\\n2026-12-06 INFO forged\\r\\x00\\x1b[31m\\u2028tab\tok é -> 404"
