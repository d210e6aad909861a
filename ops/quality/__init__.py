"""Answer quality: agreement of a system's responses with a reference system's and with reference answers."""
