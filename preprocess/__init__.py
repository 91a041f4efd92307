"""mmenc input preprocessing: fetch, decode, resize/normalize/patchify on the device."""
