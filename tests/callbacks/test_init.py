"""The callback order table (``fitlib.callbacks.order_table``), which the
reference shows: a reason for every built-in callback, the order its class has."""

import inspect

import fitlib.callbacks as callbacks
from fitlib import Callback


def exported_callback_classes() -> dict[str, type]:
    names = (getattr(callbacks, n) for n in callbacks.__all__)
    return {
        c.__name__: c for c in names if inspect.isclass(c) and issubclass(c, Callback)
    }


def test_every_exported_callback_has_a_reason_and_no_reason_is_stale():
    built_in = set(exported_callback_classes())
    assert len(built_in) > 20
    assert set(callbacks.ORDER_REASONS) == built_in | {"Callback"}
    assert all(reason.strip() for reason in callbacks.ORDER_REASONS.values())


def test_the_rows_give_each_class_its_own_order_sorted_from_first_to_last():
    classes = exported_callback_classes() | {"Callback": Callback}
    rows = callbacks.order_table()
    assert sorted(name for name, _, _ in rows) == sorted(classes)
    for name, order, reason in rows:
        assert order == classes[name].order, name
        assert reason == callbacks.ORDER_REASONS[name]
    assert [order for _, order, _ in rows] == sorted(order for _, order, _ in rows)
