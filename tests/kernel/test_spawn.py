"""A kernel's sandbox as it is spawned (:mod:`sequester.kernel.spawn`, pure): the
capabilities the kernel and a view keep."""


def test_kernel_caps_and_the_view_only_caps():
    from sequester.kernel.spawn import _caps

    assert "CAP_SYS_ADMIN" in _caps(False, True) and "CAP_NET_ADMIN" in _caps(True, True)
    assert "CAP_NET_BIND_SERVICE" not in _caps(False, True)  # the kernel's own netns lets every port bind
    assert not {"CAP_SYS_ADMIN", "CAP_NET_ADMIN"} & set(_caps(True, False) + _caps(False, False))
