//! The one signing algorithm ttlab uses, as a `jsonwebtoken` crypto provider: HMAC-SHA256 over
//! RustCrypto's `hmac` and `sha2`. jsonwebtoken is built without a bundled backend (its
//! `rust_crypto` backend would also compile RSA, ECDSA and EdDSA); every other algorithm is
//! refused here, besides `Validation` accepting only HS256.

use hmac::{Hmac, KeyInit, Mac};
use jsonwebtoken::crypto::{CryptoProvider, JwtSigner, JwtVerifier, KeyUtils};
use jsonwebtoken::errors::{Error, ErrorKind};
use jsonwebtoken::{Algorithm, AlgorithmFamily, DecodingKey, EncodingKey};
use sha2::Sha256;

type HmacSha256 = Hmac<Sha256>;

struct Hs256(HmacSha256);

impl Hs256 {
    fn new(key: &[u8]) -> Result<Self, Error> {
        HmacSha256::new_from_slice(key)
            .map(Self)
            .map_err(|_| ErrorKind::InvalidKeyFormat.into())
    }
}

impl signature::Signer<Vec<u8>> for Hs256 {
    fn try_sign(&self, msg: &[u8]) -> Result<Vec<u8>, signature::Error> {
        let mut mac = self.0.clone();
        mac.update(msg);
        Ok(mac.finalize().into_bytes().to_vec())
    }
}

impl signature::Verifier<Vec<u8>> for Hs256 {
    fn verify(&self, msg: &[u8], sig: &Vec<u8>) -> Result<(), signature::Error> {
        let mut mac = self.0.clone();
        mac.update(msg);
        // Constant-time comparison.
        mac.verify_slice(sig).map_err(|_| signature::Error::new())
    }
}

impl JwtSigner for Hs256 {
    fn algorithm(&self) -> Algorithm {
        Algorithm::HS256
    }
}

impl JwtVerifier for Hs256 {
    fn algorithm(&self) -> Algorithm {
        Algorithm::HS256
    }
}

fn signer(alg: &Algorithm, key: &EncodingKey) -> Result<Box<dyn JwtSigner>, Error> {
    if *alg != Algorithm::HS256 || key.family() != AlgorithmFamily::Hmac {
        return Err(ErrorKind::InvalidAlgorithm.into());
    }
    Ok(Box::new(Hs256::new(key.as_bytes())?))
}

fn verifier(alg: &Algorithm, key: &DecodingKey) -> Result<Box<dyn JwtVerifier>, Error> {
    if *alg != Algorithm::HS256 || key.family() != AlgorithmFamily::Hmac {
        return Err(ErrorKind::InvalidAlgorithm.into());
    }
    Ok(Box::new(Hs256::new(key.try_get_as_bytes()?)?))
}

static PROVIDER: CryptoProvider = CryptoProvider {
    signer_factory: signer,
    verifier_factory: verifier,
    // No JWKs: ttlab's keys are a shared secret.
    key_utils: KeyUtils::new_unimplemented(),
};

/// Installs the provider for the process (once; a provider another part of the process
/// installed first is kept, and HS256 is all ttlab asks of it).
pub(crate) fn install() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        let _ = PROVIDER.install_default();
    });
}
