"""Link from the encoder fleet to the prefill/decode engine (wire format, client, bundled engine)."""
