//! TLS, with rustls and the ring provider: libpq's `sslmode` and
//! `sslrootcert` of `postgres.url` for the connections sqlx does not make
//! (tokio-postgres, for database creation and refinery's migrations; sqlx
//! reads the same parameters itself, see `durable::connect_options`), CA
//! files in PEM, and telling a TLS failure from others so that start-up can
//! name the setting at fault.
//!
//! | `sslmode` | encrypts | verifies the chain | verifies the host name |
//! |---|---|---|---|
//! | `disable` | no | | |
//! | `prefer` (the default) | if the server offers it | no | no |
//! | `require` | yes | no (yes with `sslrootcert`, as libpq) | no |
//! | `verify-ca` | yes | yes | no |
//! | `verify-full` | yes | yes | yes |
//!
//! Chains are verified against `sslrootcert` when given, else the system's
//! roots (as sqlx does with the same URL).

use std::path::{Path, PathBuf};
use std::sync::Arc;

use anyhow::Context;
use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use rustls::client::WebPkiServerVerifier;
use rustls::crypto::{verify_tls12_signature, verify_tls13_signature, CryptoProvider};
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, ServerName, UnixTime};
use rustls::{
    CertificateError, ClientConfig, DigitallySignedStruct, RootCertStore, SignatureScheme,
};

/// Makes ring the process's rustls provider (the redis crate builds its
/// configurations with the default one). Idempotent.
pub fn install_provider() {
    let _ = rustls::crypto::ring::default_provider().install_default();
}

fn provider() -> Arc<CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

/// libpq's `sslmode`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SslMode {
    Disable,
    Prefer,
    Require,
    VerifyCa,
    VerifyFull,
}

impl SslMode {
    pub fn parse(text: &str) -> Option<SslMode> {
        Some(match text {
            "disable" => SslMode::Disable,
            "prefer" => SslMode::Prefer,
            "require" => SslMode::Require,
            "verify-ca" => SslMode::VerifyCa,
            "verify-full" => SslMode::VerifyFull,
            _ => return None,
        })
    }

    pub fn as_str(self) -> &'static str {
        match self {
            SslMode::Disable => "disable",
            SslMode::Prefer => "prefer",
            SslMode::Require => "require",
            SslMode::VerifyCa => "verify-ca",
            SslMode::VerifyFull => "verify-full",
        }
    }
}

/// What `postgres.url` asks of TLS.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PgTls {
    /// As written (`prefer` when absent).
    pub mode: SslMode,
    /// `sslrootcert`: the CA certificates (PEM) that verify the server.
    pub root_cert: Option<PathBuf>,
}

/// Query parameters that sqlx reads and tokio-postgres does not know (it
/// refuses unknown ones); TLS is set on its `Config` separately.
const NOT_FOR_TOKIO_POSTGRES: &[&str] = &[
    "sslmode",
    "sslrootcert",
    "sslcert",
    "sslkey",
    "statement-cache-capacity",
];

impl PgTls {
    /// Reads `sslmode` and `sslrootcert` from the URL's query string; the
    /// root certificate file must exist and hold at least one certificate.
    /// The error says what is wrong (the caller names `postgres.url`).
    pub fn from_url(url: &str) -> Result<PgTls, String> {
        let parsed = url::Url::parse(url).map_err(|e| format!("not a URL: {e}"))?;
        let mut mode = SslMode::Prefer;
        let mut root_cert = None;
        for (k, v) in parsed.query_pairs() {
            match k.as_ref() {
                "sslmode" => {
                    mode = SslMode::parse(&v).ok_or_else(|| {
                        format!("sslmode `{v}` is not one of disable, prefer, require, verify-ca, verify-full")
                    })?;
                }
                "sslrootcert" => root_cert = Some(PathBuf::from(v.as_ref())),
                "sslcert" | "sslkey" => {
                    return Err(format!(
                        "{k}: client certificates are not supported; authenticate with a password"
                    ))
                }
                _ => {}
            }
        }
        if let Some(path) = &root_cert {
            load_certs(path).map_err(|e| format!("sslrootcert: {e}"))?;
        }
        Ok(PgTls { mode, root_cert })
    }

    /// The mode in force: libpq treats `require` with a root certificate as
    /// `verify-ca`.
    pub fn effective_mode(&self) -> SslMode {
        match (self.mode, &self.root_cert) {
            (SslMode::Require, Some(_)) => SslMode::VerifyCa,
            (m, _) => m,
        }
    }

    /// `postgres.url (sslmode=..., sslrootcert=...)`, for error messages.
    pub fn describe(&self) -> String {
        match &self.root_cert {
            Some(p) => format!(
                "postgres.url (sslmode={}, sslrootcert={})",
                self.mode.as_str(),
                p.display()
            ),
            None => format!("postgres.url (sslmode={})", self.mode.as_str()),
        }
    }

    /// The rustls configuration of this mode.
    pub fn client_config(&self) -> anyhow::Result<ClientConfig> {
        let builder = ClientConfig::builder_with_provider(provider())
            .with_safe_default_protocol_versions()
            .context("TLS protocol versions")?;
        let config = match self.effective_mode() {
            SslMode::Disable | SslMode::Prefer | SslMode::Require => builder
                .dangerous()
                .with_custom_certificate_verifier(Arc::new(AnyCertificate(provider())))
                .with_no_client_auth(),
            SslMode::VerifyCa => {
                let inner = WebPkiServerVerifier::builder_with_provider(
                    Arc::new(roots(self.root_cert.as_deref())?),
                    provider(),
                )
                .build()
                .context("building the certificate verifier")?;
                builder
                    .dangerous()
                    .with_custom_certificate_verifier(Arc::new(AnyHostName(inner)))
                    .with_no_client_auth()
            }
            SslMode::VerifyFull => builder
                .with_root_certificates(roots(self.root_cert.as_deref())?)
                .with_no_client_auth(),
        };
        Ok(config)
    }
}

/// A tokio-postgres configuration and TLS connector for `url`, honouring its
/// `sslmode` and `sslrootcert` like sqlx does.
pub fn tokio_postgres(
    url: &str,
) -> anyhow::Result<(
    tokio_postgres::Config,
    tokio_postgres_rustls::MakeRustlsConnect,
    PgTls,
)> {
    let tls = PgTls::from_url(url).map_err(|e| anyhow::anyhow!("postgres.url: {e}"))?;
    let mut parsed = url::Url::parse(url).context("postgres.url")?;
    let kept: Vec<(String, String)> = parsed
        .query_pairs()
        .filter(|(k, _)| !NOT_FOR_TOKIO_POSTGRES.contains(&k.as_ref()))
        .map(|(k, v)| (k.into_owned(), v.into_owned()))
        .collect();
    if kept.is_empty() {
        parsed.set_query(None);
    } else {
        parsed.query_pairs_mut().clear().extend_pairs(kept);
    }
    let mut config: tokio_postgres::Config = parsed
        .as_str()
        .parse()
        .context("postgres.url is not a valid connection URL")?;
    config.ssl_mode(match tls.effective_mode() {
        SslMode::Disable => tokio_postgres::config::SslMode::Disable,
        SslMode::Prefer => tokio_postgres::config::SslMode::Prefer,
        SslMode::Require | SslMode::VerifyCa | SslMode::VerifyFull => {
            tokio_postgres::config::SslMode::Require
        }
    });
    let connector = tokio_postgres_rustls::MakeRustlsConnect::new(
        tls.client_config().with_context(|| tls.describe())?,
    );
    Ok((config, connector, tls))
}

/// The certificates of a PEM file (at least one).
pub fn load_certs(path: &Path) -> Result<Vec<CertificateDer<'static>>, String> {
    let pem = std::fs::read(path).map_err(|e| format!("cannot read {}: {e}", path.display()))?;
    parse_certs(&pem).map_err(|e| format!("{}: {e}", path.display()))
}

/// The certificates of PEM text (at least one).
pub fn parse_certs(pem: &[u8]) -> Result<Vec<CertificateDer<'static>>, String> {
    let certs: Vec<CertificateDer<'static>> = CertificateDer::pem_slice_iter(pem)
        .collect::<Result<_, _>>()
        .map_err(|e| format!("not PEM certificates: {e}"))?;
    if certs.is_empty() {
        return Err("holds no PEM certificate".to_owned());
    }
    Ok(certs)
}

/// `file`'s certificates, or the system's roots.
fn roots(file: Option<&Path>) -> anyhow::Result<RootCertStore> {
    let mut store = RootCertStore::empty();
    match file {
        Some(path) => {
            for cert in load_certs(path).map_err(|e| anyhow::anyhow!("sslrootcert: {e}"))? {
                store
                    .add(cert)
                    .context("sslrootcert: not a CA certificate")?;
            }
        }
        None => {
            let found = rustls_native_certs::load_native_certs();
            let (added, _) = store.add_parsable_certificates(found.certs);
            anyhow::ensure!(
                added > 0,
                "no system root certificates found (install ca-certificates, or name the CA with sslrootcert)"
            );
        }
    }
    Ok(store)
}

/// `prefer` and `require`: encrypted, not authenticated (libpq's meaning).
/// Handshake signatures are still checked.
#[derive(Debug)]
struct AnyCertificate(Arc<CryptoProvider>);

impl ServerCertVerifier for AnyCertificate {
    fn verify_server_cert(
        &self,
        _end_entity: &CertificateDer<'_>,
        _intermediates: &[CertificateDer<'_>],
        _server_name: &ServerName<'_>,
        _ocsp: &[u8],
        _now: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        Ok(ServerCertVerified::assertion())
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        verify_tls12_signature(
            message,
            cert,
            dss,
            &self.0.signature_verification_algorithms,
        )
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        verify_tls13_signature(
            message,
            cert,
            dss,
            &self.0.signature_verification_algorithms,
        )
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.0.signature_verification_algorithms.supported_schemes()
    }
}

/// `verify-ca`: the chain must verify; the name in it need not match.
#[derive(Debug)]
struct AnyHostName(Arc<WebPkiServerVerifier>);

impl ServerCertVerifier for AnyHostName {
    fn verify_server_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        server_name: &ServerName<'_>,
        ocsp: &[u8],
        now: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        match self
            .0
            .verify_server_cert(end_entity, intermediates, server_name, ocsp, now)
        {
            Err(rustls::Error::InvalidCertificate(
                CertificateError::NotValidForName | CertificateError::NotValidForNameContext { .. },
            )) => Ok(ServerCertVerified::assertion()),
            other => other,
        }
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        self.0.verify_tls12_signature(message, cert, dss)
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        self.0.verify_tls13_signature(message, cert, dss)
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.0.supported_verify_schemes()
    }
}

/// Whether `e` or one of its causes is a TLS failure (a rustls error, also
/// inside an I/O error, or a driver's TLS error such as "server does not
/// support TLS").
pub fn is_tls_error(e: &(dyn std::error::Error + 'static)) -> bool {
    let mut cur: Option<&(dyn std::error::Error + 'static)> = Some(e);
    while let Some(err) = cur {
        if err.downcast_ref::<rustls::Error>().is_some() {
            return true;
        }
        if let Some(io) = err.downcast_ref::<std::io::Error>() {
            if io
                .get_ref()
                .is_some_and(|inner| inner.downcast_ref::<rustls::Error>().is_some())
            {
                return true;
            }
        }
        if matches!(err.downcast_ref::<sqlx::Error>(), Some(sqlx::Error::Tls(_))) {
            return true;
        }
        let text = err.to_string().to_ascii_lowercase();
        if text.contains("tls") || text.contains("certificate") || text.contains("handshake") {
            return true;
        }
        cur = err.source();
    }
    false
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sslmode_and_rootcert_are_read_from_the_url() {
        let t = PgTls::from_url("postgres://u@h:5432/db").unwrap();
        assert_eq!((t.mode, t.root_cert), (SslMode::Prefer, None));
        let t = PgTls::from_url("postgres://u@h/db?sslmode=verify-full").unwrap();
        assert_eq!(t.effective_mode(), SslMode::VerifyFull);
        let err = PgTls::from_url("postgres://u@h/db?sslmode=always").unwrap_err();
        assert!(err.contains("sslmode"), "{err}");
        let err = PgTls::from_url("postgres://u@h/db?sslmode=require&sslrootcert=/no/such.pem")
            .unwrap_err();
        assert!(
            err.contains("sslrootcert") && err.contains("/no/such.pem"),
            "{err}"
        );
        assert!(PgTls::from_url("postgres://u@h/db?sslcert=/c.pem").is_err());
        let tls = PgTls {
            mode: SslMode::Require,
            root_cert: Some("/ca.pem".into()),
        };
        assert_eq!(tls.effective_mode(), SslMode::VerifyCa, "as libpq");
    }

    #[test]
    fn tokio_postgres_gets_only_the_parameters_it_knows() {
        let (config, _, tls) = tokio_postgres(
            "postgres://u:p@127.0.0.1:5433/ledger?sslmode=require&application_name=x&statement-cache-capacity=10",
        )
        .unwrap();
        assert_eq!(tls.mode, SslMode::Require);
        assert_eq!(
            config.get_ssl_mode(),
            tokio_postgres::config::SslMode::Require
        );
        assert_eq!(config.get_dbname(), Some("ledger"));
        assert_eq!(config.get_application_name(), Some("x"));
        let (config, _, _) = tokio_postgres("postgres://u@h/db?sslmode=disable").unwrap();
        assert_eq!(
            config.get_ssl_mode(),
            tokio_postgres::config::SslMode::Disable
        );
    }

    #[test]
    fn pem_without_certificates_is_refused() {
        assert!(parse_certs(b"").is_err());
        assert!(parse_certs(b"hello").is_err());
    }
}
