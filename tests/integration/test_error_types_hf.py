"""The exception classes of the modules that import the Hugging Face stack are infinity errors too
(tests/unit/test_error_types.py checks the rest without importing that stack)."""
import sys

from test_error_types import check_is_an_infinity_error, exception_classes


def test_every_exception_class_of_the_hf_modules_is_an_infinity_error():
    for name, cls in exception_classes(hf=True):
        check_is_an_infinity_error(name, cls)
    assert "infinity.integrations.transformers" in sys.modules  # the scan reached the modules it is for
