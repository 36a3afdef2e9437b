"""The ground floor, imported by every other room and importing none of them."""
