//! Reading a row's columns, for every table's row decoding: a value the driver cannot read
//! as the asked-for type, or text the model refuses, is a [`StoreError::Corrupt`] naming the
//! column.

use std::fmt;
use std::str::FromStr;

use tokio_postgres::Row;
use tokio_postgres::types::FromSql;

use crate::StoreError;

/// The value of `column`.
pub(crate) fn get<'a, T: FromSql<'a>>(row: &'a Row, column: &'static str) -> Result<T, StoreError> {
    row.try_get(column)
        .map_err(|e| StoreError::corrupt(column, crate::error::pg_reason(&e)))
}

/// The value of an `integer` `column` that is never negative (a count, a size).
pub(crate) fn non_negative(row: &Row, column: &'static str) -> Result<u32, StoreError> {
    let n: i32 = get(row, column)?;
    u32::try_from(n).map_err(|_| StoreError::corrupt(column, "negative"))
}

/// The text of `column`, parsed (an id, a name, a status).
pub(crate) fn parse<T: FromStr>(row: &Row, column: &'static str) -> Result<T, StoreError>
where
    T::Err: fmt::Display,
{
    let text: &str = get(row, column)?;
    text.parse().map_err(|e| StoreError::corrupt(column, e))
}

/// The text of a nullable `column`, parsed.
pub(crate) fn parse_opt<T: FromStr>(
    row: &Row,
    column: &'static str,
) -> Result<Option<T>, StoreError>
where
    T::Err: fmt::Display,
{
    let text: Option<&str> = get(row, column)?;
    text.map(|t| t.parse().map_err(|e| StoreError::corrupt(column, e)))
        .transpose()
}
