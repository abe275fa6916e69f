"""The kernel: its wire protocol, the in-sandbox server and the host-side client."""
